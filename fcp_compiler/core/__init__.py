"""The compiler core: the frozen IR (`ir`), one pass a module (`passes/`), the baselines' placements, the pipeline
that runs the passes in order (`pipeline.compile_plan`) and the plan's statistics. It builds on `algorithms/` and
on the plan format (`format/`), and never imports the tools or the runtime."""
