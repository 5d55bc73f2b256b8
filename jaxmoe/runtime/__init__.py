"""The processes a run is made of: joining several (`distributed`: flags, environment,
SLURM, Open MPI; the peer watch), one training per run directory (`run_lock`), and fake
CPU devices for tests and the planner (`fake_devices`, which starts nothing: it is read
before JAX starts)."""
