from pathlib import Path

from fcp_compiler.format.schemas import schema_documents

ROOT = Path(__file__).resolve().parents[1]


def test_schema_files_match_the_models():
    documents = schema_documents()
    assert set(documents) == {p.name for p in (ROOT / "schemas").glob("*.json")}
    for name, text in documents.items():
        assert (ROOT / "schemas" / name).read_text() == text, f"schemas/{name} is stale: run `fcp schemas`"
