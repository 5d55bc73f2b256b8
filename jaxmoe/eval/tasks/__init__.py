"""jaxmoe's own lm-eval tasks: a YAML each (what lm-eval reads, with
`--include-path` or through `python -m jaxmoe.eval`) and the code that makes its docs."""
