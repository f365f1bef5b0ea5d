"""fcp: a schedule compiler for flexible context parallelism.

Names are resolved lazily, so `import fcp_compiler.format.plan_format` (what the runtime reads plans with) does not load
the passes, and importing the package stays cheap in data-loader workers.
"""

from importlib import import_module

_EXPORTS = {
    "FcpError": "fcp_compiler.errors", "InfeasibleError": "fcp_compiler.errors",
    "InvalidInputError": "fcp_compiler.errors", "PlanFormatError": "fcp_compiler.errors",
    "CompiledPlan": "fcp_compiler.core.pipeline", "compile_plan": "fcp_compiler.core.pipeline",
    "CompileOptions": "fcp_compiler.core.options",
    "PlanReader": "fcp_compiler.format.plan_format", "RankProgram": "fcp_compiler.format.plan_format",
    "load_rank_program": "fcp_compiler.format.plan_format",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fcp_compiler' has no attribute {name!r}")
