"""The trainers ``--parallel`` names, and which of them are pipelines. Pure: no MPI here, so
the command line's parser and the option table read the same list the factory checks."""

PARALLEL = ("data", "pipeline", "hybrid")  # mpidp.parallel.trainers.make_trainer's names
PIPELINED = ("pipeline", "hybrid")  # the model cut into stages (hybrid: several replicas)
HYBRID_STAGES = 2  # default stages per pipeline for "hybrid"
