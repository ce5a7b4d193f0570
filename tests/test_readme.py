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
