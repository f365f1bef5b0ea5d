"""JSON Schema documents for every boundary model: the batch, the hardware profile, the attention shape, the plan
header and the kinds header (one plan for each layer kind): written to and checked against `schemas/` by
`fcp schemas`."""

from __future__ import annotations

import json

from pydantic import BaseModel

from fcp_compiler.format.inputs import SCHEMA_VERSION, AttentionShape, BatchSpec, HardwareProfile
from fcp_compiler.format.kinds import KINDS_FORMAT, KindsHeader
from fcp_compiler.format.plan_format import FORMAT_VERSION, PlanHeader

SCHEMA_MODELS: dict[str, type[BaseModel]] = {
    "batch": BatchSpec,
    "hardware_profile": HardwareProfile,
    "attention_shape": AttentionShape,
}


def schema_documents() -> dict[str, str]:
    """Return ``{file name: JSON Schema text}`` for every boundary model, plan header included."""
    # The plan header's schema follows the plan format's version; the input models have their own.
    models = {name: (model, SCHEMA_VERSION) for name, model in SCHEMA_MODELS.items()}
    models["plan_header"] = (PlanHeader, FORMAT_VERSION)
    models["kinds_header"] = (KindsHeader, KINDS_FORMAT)  # a plan for each layer kind (format/kinds.py)
    documents = {}
    for name, (model, version) in models.items():
        schema = model.model_json_schema()
        schema["$id"] = f"https://fcp.dev/schemas/{name}.v{version}.json"
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        documents[f"{name}.v{version}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return documents
