"""Data-parallel MLP with mpidp's public API.  Run: mpiexec -n 4 python examples/train_mlp.py"""
import mpidp  # import before numpy: it sets one BLAS thread pool per rank that fits the node
import numpy as np
from mpi4py import MPI
from mpidp import nn

comm = MPI.COMM_WORLD
# Each rank reads only its own rows (no communication); same data for any number of ranks.
data = mpidp.load(comm, "synthetic", n_samples=4000, n_features=32, n_classes=4,
                  distribute="local", dtype=np.float64, seed=0)
model = nn.mlp(data.n_features, hidden=(64,), n_out=data.n_outputs, dtype=np.float64)
model.init_(np.random.default_rng(0))
dp = mpidp.DataParallel(model, nn.Adam(1e-2), nn.SoftmaxCrossEntropy(), comm)  # Bcast init
history = mpidp.fit(dp, data.train, epochs=4, batch_size=128, seed=0, test=data.test)
mpidp.assert_in_sync(comm, model.params)  # all replicas bit-identical
if comm.rank == 0:
    print(f"ranks {comm.size}  test accuracy {history[-1]['test_accuracy']:.3f}")
