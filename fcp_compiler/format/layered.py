"""Temporary alias of fcp_compiler.format.kinds for fcp_compiler/core/pipeline.py only, which was being edited
elsewhere when the module was renamed (issue 65 item 9). Remove this file once pipeline.py imports encode_kinds
from fcp_compiler.format.kinds."""

from fcp_compiler.format.kinds import encode_kinds as encode_layered  # noqa: F401
