"""fcp: a schedule compiler for flexible context parallelism."""
