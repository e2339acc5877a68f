#!/bin/bash
# Train with mpidp under PBS Pro or Torque: `qsub examples/cluster/pbs.sh`.
#
# PBS starts this script on the first node; mpiexec launches the ranks on the nodes listed
# in $PBS_NODEFILE (one line per slot). Add `-l` options your site requires (queue, account).
#PBS -N mpidp
#PBS -l select=2:ncpus=32:mpiprocs=4
# (Torque: #PBS -l nodes=2:ppn=4)
#PBS -l walltime=02:00:00
#PBS -j oe

set -uo pipefail
cd "${PBS_O_WORKDIR:-$PWD}"

# module load openmpi            # or mpich: the MPI that mpi4py was built against or loads
source "${MPIDP_VENV:-$HOME/venvs/mpidp}/bin/activate"

NP=$(wc -l < "$PBS_NODEFILE")
# 32 cores per node shared by 4 ranks: 8 BLAS threads each.
export OMP_NUM_THREADS=8 OPENBLAS_NUM_THREADS=8
RUN_DIR=${RUN_DIR:-$PWD/runs/mpidp}
mkdir -p "$RUN_DIR"

TRAIN=(mpidp train --dataset "$RUN_DIR/data.npz" --model mlp --hidden 256,128
       --epochs 50 --batch-size 512 --lr 0.05 --seed 0
       --checkpoint-dir "$RUN_DIR/checkpoints" --checkpoint-every 200 --resume
       --no-progress --out "$RUN_DIR/out")

if mpiexec --version 2>&1 | grep -q "Open MPI"; then
  # Open MPI reads PBS's node list itself (when built with PBS/TM support); -x passes
  # variables on to the ranks.
  mpiexec -n "$NP" --map-by ppr:4:node -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS \
    -x PATH -x VIRTUAL_ENV "${TRAIN[@]}"
else
  # MPICH's Hydra passes the whole environment on; -f names the hosts.
  mpiexec -f "$PBS_NODEFILE" -n "$NP" "${TRAIN[@]}"
fi
# Exit status 75: stopped by SIGTERM/SIGUSR1 after a checkpoint; submit again to continue.
