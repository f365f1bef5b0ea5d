"""The boundary: input models (`inputs`), the plan file format and its reader (`plan_format`, `plan_structure`),
the independent validator (`validate`), safe file I/O (`safe_io`) and the JSON Schemas (`schemas`). The runtime
reads plans through this layer alone; it imports nothing from the compiler core."""
