"""What a config costs before it runs: `python -m jaxmoe.plan` (memory, FLOPs, traffic
and a roofline read off the compiled program), the GPUs it compiles for without one,
the readers of a compiled program, and `python -m jaxmoe.plan.bench`, which measures."""
