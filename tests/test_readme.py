"""The README's options table is generated from EngineConfig and must not drift from it."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_options_table_matches_config():
    spec = importlib.util.spec_from_file_location("update_readme_options", os.path.join(ROOT, "tools", "update_readme_options.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert mod.START in text and mod.END in text
    assert mod.render(text) == text, "README options table is stale: run python tools/update_readme_options.py"


def test_verified_claims_name_tests_that_exist():
    """Every test the README's "What was verified where" names is a test function in that file."""
    import re

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("## What was verified where")
    section = text[start:text.index("\n## ", start + 1)]
    named = re.findall(r"`(test_\w+\.py)(?:::(test_\w+))?`", section)
    assert len(named) > 30
    for path, name in named:
        full = os.path.join(ROOT, "tests", path)
        assert os.path.exists(full), path
        if name:
            with open(full, encoding="utf-8") as f:
                assert re.search(rf"^def {name}\(", f.read(), re.M), f"{path}::{name}"
