"""Tools over compiled plans: the simulator, baselines comparison, ablation, diff, bulk compile, traces, plots and
every table the CLI prints (`report`). Tools may use the core and the format; nothing below imports them."""
