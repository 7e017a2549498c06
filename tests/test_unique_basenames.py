"""pytest imports test modules by basename (rootdir mode, no packages): two test files of one name in tests/ and
tests/gpu/ stop the whole run at collection, which a run of single files never shows."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_two_test_modules_share_a_basename():
    seen: dict[str, Path] = {}
    for p in sorted(TESTS.rglob("*.py")):
        if p.name == "conftest.py" or "__pycache__" in p.parts:
            continue
        assert p.name not in seen, f"{p.relative_to(TESTS)} and {seen[p.name].relative_to(TESTS)} share a basename"
        seen[p.name] = p
