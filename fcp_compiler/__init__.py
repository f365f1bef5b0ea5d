"""fcp: a schedule compiler for flexible context parallelism.

Import cost matters (data loaders import this in every worker): only numpy, msgpack and pydantic are loaded here.
"""

from fcp_compiler.errors import FcpError, InfeasibleError, InvalidInputError, PlanFormatError
from fcp_compiler.pipeline import CompiledPlan, compile_plan
from fcp_compiler.plan_format import PlanReader, RankProgram, load_rank_program

__all__ = ["CompiledPlan", "FcpError", "InfeasibleError", "InvalidInputError", "PlanFormatError", "PlanReader",
           "RankProgram", "compile_plan", "load_rank_program"]
