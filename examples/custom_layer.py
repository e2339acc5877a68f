"""A user's own layer and optimizer, a callback that stops early, save, reload, predict.
Run: mpiexec -n 2 python examples/custom_layer.py [OUT_FILE.npz]"""
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


class SignSGD(nn.Optimizer):
    """p -= lr * sign(mean gradient): elementwise, so it works on any piece of the vector."""

    def _update(self, params, grad, state, scale, first):
        params -= self.lr * np.sign(self._grad(params, grad, scale))


comm = MPI.COMM_WORLD
out = sys.argv[1] if len(sys.argv) > 1 else "out/custom.npz"
data = mpidp.load(comm, "digits", distribute="local", dtype=np.float64, seed=0)
model = nn.Sequential([nn.Flatten(), nn.Dense(64, 64), Leaky(0.1), nn.Dense(64, 10)],
                      data.sample_shape, np.float64)  # digits: (1, 8, 8) images
model.init_(np.random.default_rng(0))
dp = mpidp.DataParallel(model, SignSGD(1e-3), nn.SoftmaxCrossEntropy(), comm)


def enough(record: dict) -> bool:  # on every rank; True on any one rank stops them all
    return record["test_accuracy"] >= 0.95


history = mpidp.fit(dp, data.train, epochs=30, batch_size=64, test=data.test, on_epoch=enough)
if comm.rank == 0:
    nn.save(model, out)  # the model.npz layout `mpidp train` writes
    again = nn.load(out)  # needs Leaky registered, as above
    X, y = data.test.X, data.test.y  # rank 0's part of the test set
    same = np.array_equal(again.predict(X, "label"), model.predict(X, "label"))
    print(f"ranks {comm.size}  epochs {len(history)}  test accuracy "
          f"{history[-1]['test_accuracy']:.3f}  reloaded model agrees: {same}")
