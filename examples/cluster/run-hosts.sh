#!/usr/bin/env bash
# Run mpidp on the hosts of a host file, without a batch system, with MPICH or Open MPI.
#
#   MPI=mpich   bash examples/cluster/run-hosts.sh [HOSTFILE] [-- mpidp train options]
#   MPI=openmpi bash examples/cluster/run-hosts.sh [HOSTFILE] [-- mpidp train options]
#
# Every host needs passwordless ssh from this one, the same MPI, and this Python
# environment at the same path (a shared file system, or the same install on each).
# NP ranks in all, PPN per host; PYTHON is the environment's interpreter.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
MPI=${MPI:-mpich}
NP=${NP:-8}
PPN=${PPN:-4}
MPIEXEC=${MPIEXEC:-mpiexec}
PYTHON=${PYTHON:-$(command -v python3)}
THREADS=${THREADS:-1}  # BLAS threads per rank: the host's cores / PPN

case "$MPI" in
  mpich) hostfile=$here/hosts.mpich ;;
  openmpi) hostfile=$here/hosts.openmpi ;;
  *) echo "MPI must be mpich or openmpi, not '$MPI'" >&2; exit 2 ;;
esac
if [ $# -gt 0 ] && [ "$1" != "--" ]; then hostfile=$1; shift; fi
[ "${1:-}" = "--" ] && shift
if [ $# -eq 0 ]; then
  set -- --dataset synthetic --n-samples 20000 --epochs 2 --out out/hosts
fi

case "$MPI" in
  mpich)
    # Hydra: -f HOSTFILE, -ppn ranks per host, -genv a variable for every rank (the rest
    # of the environment is passed on too).
    exec "$MPIEXEC" -f "$hostfile" -n "$NP" -ppn "$PPN" -genv OMP_NUM_THREADS "$THREADS" \
      "$PYTHON" -m mpidp train "$@" ;;
  openmpi)
    # Open MPI: --hostfile, --map-by ppr:N:node ranks per host, -x passes a variable on
    # (only those named are). As root it also needs OMPI_ALLOW_RUN_AS_ROOT=1 and
    # OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 in the environment.
    exec "$MPIEXEC" --hostfile "$hostfile" -n "$NP" --map-by "ppr:$PPN:node" \
      -x "OMP_NUM_THREADS=$THREADS" -x PATH "$PYTHON" -m mpidp train "$@" ;;
esac
