"""A user's own layers (one sums over the ranks) and optimizer, a callback that stops early,
save, reload, predict.
Run: mpiexec -n 2 python examples/custom_layer.py [OUT_FILE.npz]"""
import os
import sys

import mpidp  # import before numpy: it sets one BLAS thread pool per rank that fits the node
import numpy as np
from mpi4py import MPI
from mpidp import nn


@nn.register_layer  # so that nn.load can rebuild a saved model that uses it
class Leaky(nn.Layer):
    """max(x, slope * x): no parameters, one setting."""

    def __init__(self, slope: float = 0.01) -> None:
        super().__init__()
        self.slope = slope

    def config(self) -> dict:  # the settings that rebuild it (JSON-able)
        return {"slope": self.slope}

    def forward(self, x):  # (n, *shape) -> (n, *shape), caching what backward needs
        self.mask = x > 0
        return np.where(self.mask, x, self.slope * x)

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return np.where(self.mask, dy, self.slope * dy)  # no parameters: no grads to write


@nn.register_layer
class Centre(nn.Layer):
    """x - mean over the GLOBAL batch of each feature (a running mean at evaluation): a
    layer that sums over the ranks holding the batch, without importing MPI."""

    needs = frozenset({"replica-sums"})  # modes that cannot sum over the batch refuse it

    def output_shape(self, in_shape):  # called once, before state_shapes: fix the width
        self.width = in_shape[-1]
        return in_shape

    def state_shapes(self):  # untrained values: saved, checkpointed, the same on every rank
        return {"mean": (self.width,)}

    def forward(self, x):  # (n, width)
        if not self.context.training:
            return x - self.state["mean"]
        sums = np.concatenate([[len(x)], x.sum(axis=0)])  # every rank calls, even with n = 0
        sums = self.context.reduce_sum(sums)  # the whole batch's count and sums, every rank
        self.n, mean = sums[0], sums[1:] / max(sums[0], 1)
        self.state["mean"][...] = 0.9 * self.state["mean"] + 0.1 * mean
        return x - mean

    def backward(self, dy, accumulate=False, need_input_grad=True):
        if not need_input_grad:
            return None
        total = self.context.reduce_sum(dy.sum(axis=0))  # dL/dx_i = dy_i - sum(dy) / N
        return dy - total / max(self.n, 1)


class SignSGD(nn.Optimizer):
    """p -= lr * sign(mean gradient): elementwise, so it works on any piece of the vector."""

    def _update(self, params, grad, state, scale, first):
        params -= self.lr * np.sign(self._grad(params, grad, scale))


comm = MPI.COMM_WORLD
out = sys.argv[1] if len(sys.argv) > 1 else "out/custom.npz"
data = mpidp.load(comm, "digits", distribute="local", dtype=np.float64, seed=0)
model = nn.Sequential([nn.Flatten(), Centre(), nn.Dense(64, 64), Leaky(0.1), nn.Dense(64, 10)],
                      data.sample_shape, np.float64)  # digits: (1, 8, 8) images
model.init_(np.random.default_rng(0))
dp = mpidp.DataParallel(model, SignSGD(1e-3), nn.SoftmaxCrossEntropy(), comm)


def enough(record: dict) -> bool:  # on every rank; True on any one rank stops them all
    return record["test_accuracy"] >= 0.95


history = mpidp.fit(dp, data.train, epochs=30, batch_size=64, test=data.test, on_epoch=enough)
if comm.rank == 0:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    nn.save(model, out)  # the model.npz layout `mpidp train` writes
    again = nn.load(out)  # needs Leaky and Centre registered, as above
    X, y = data.test.X, data.test.y  # rank 0's part of the test set
    same = np.array_equal(again.predict(X, "label"), model.predict(X, "label"))
    print(f"ranks {comm.size}  epochs {len(history)}  test accuracy "
          f"{history[-1]['test_accuracy']:.3f}  reloaded model agrees: {same}")
