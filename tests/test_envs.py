"""fdlite/envs.py is the one place fdlite reads its environment variables, and it documents each of them.

- No other file under fdlite/ (Python, C, C++, CUDA) reads FDLITE_*, PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM,
  PADDLE_DISTRI_BACKEND or CUDA_ARCHS: Python reads are found in the syntax tree (so docstrings and comments may name them), C
  reads are getenv calls outside comments. A read whose name cannot be told (a computed key) fails too.
- Every variable listed has a default that parses and a help line; every FDLITE_* name the package mentions
  is listed.
- Values are cached at first read; refresh() reads again. The GPU ops take FDLITE_PDL / FDLITE_GEMV from
  Python (`fdl_set_options`), with the library's ABI version bumped for it.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

import pytest

from fdlite import envs

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fdlite"
ENVS = PACKAGE / "envs.py"
OWNED = re.compile(r"^(FDLITE_\w*|PADDLE_TRAINER_ID|PADDLE_TRAINERS_NUM|PADDLE_DISTRI_BACKEND|\w*CUDA_ARCHS)$")
C_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")


def _tracked(suffixes: tuple[str, ...]) -> list[Path]:
    """The files under fdlite/ that git tracks (or would: new files too), with these suffixes."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "fdlite"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = [ROOT / f for f in out.split()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file
        files = [p for p in PACKAGE.rglob("*") if p.is_file()]
    return sorted(f for f in files if f.suffix in suffixes and f.is_file())


def _is_environ(node: ast.AST) -> bool:
    """os.environ, or a bare name `environ` (an imported os.environ or a mapping parameter standing for it)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _env_reads(tree: ast.AST) -> list[tuple[int, ast.AST]]:
    """(line, key expression) of every environment read: os.environ[k], os.environ.get/pop/setdefault(k),
    os.getenv(k), k in os.environ."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            reads.append((node.lineno, node.slice))
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and _is_environ(f.value):
                reads.append((node.lineno, node.args[0]))
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name) and f.id == "getenv"):
                reads.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if any(_is_environ(c) for c in node.comparators):
                reads.append((node.lineno, node.left))
    return reads


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" assignments (a key given by such a constant is resolved)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


def python_violations(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    consts = _module_strings(tree)
    bad = []
    for line, key in _env_reads(tree):
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            name = key.value
        elif isinstance(key, ast.Name) and key.id in consts:
            name = consts[key.id]
        else:
            bad.append(f"{path.relative_to(root)}:{line}: an environment read with a computed name "
                       f"({ast.unparse(key)}): read it in fdlite/envs.py")
            continue
        if OWNED.match(name):
            bad.append(f"{path.relative_to(root)}:{line}: reads {name}: use fdlite.envs.{name}")
    return bad


def _strip_c_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def c_violations(path: Path, root: Path = ROOT) -> list[str]:
    text = _strip_c_comments(path.read_text(errors="replace"))
    bad = []
    for m in re.finditer(r"\bgetenv\s*\(\s*([^)]*)\)", text):
        arg = m.group(1).strip()
        lit = re.fullmatch(r'"(\w+)"', arg)
        if lit is None or OWNED.match(lit.group(1)):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{path.relative_to(root)}:{line}: getenv({arg}): the C++ side takes its options from "
                       "Python (fdlite/envs.py, then a setter such as fdl_set_options)")
    return bad


# --- the checker itself ---------------------------------------------------------------------------------------

def test_checker_finds_reads_not_mentions(tmp_path):
    pkg = tmp_path / "fdlite"
    pkg.mkdir()
    py = pkg / "m.py"
    py.write_text('"""Set FDLITE_X=1, i.e. os.environ.get("FDLITE_X")."""\nimport os\nfrom os import environ, getenv\n'
                  'NAME = "PADDLE_TRAINER_ID"\n# os.environ["FDLITE_Y"]\n'
                  'a = os.environ.get("FDLITE_A", "0")\nb = os.environ["FDLITE_B"]\nc = os.getenv("CUDA_ARCHS")\n'
                  'd = environ.get(NAME)\ne = "FDLITE_E" in os.environ\nf = getenv("FDLITE_CUDA_ARCHS")\n'
                  'g = os.environ.get(name_from_elsewhere)\nh = os.environ.get("HOME")\nos.environ["FDLITE_W"] = "1"\n')
    found = python_violations(py, tmp_path)
    c = pkg / "k.cu"
    c.write_text('// getenv("FDLITE_PDL")\n/* std::getenv("FDLITE_GEMV") */\nconst char* a = std::getenv("FDLITE_PDL");\n'
                 'const char* b = getenv("HOME");\nconst char* c = getenv(name);\n')
    found_c = c_violations(c, tmp_path)
    assert [f.split(":")[1] for f in found] == ["6", "7", "8", "9", "10", "11", "12"], found
    assert [f.split(":")[1] for f in found_c] == ["3", "5"], found_c


# --- the package ----------------------------------------------------------------------------------------------

def test_only_envs_py_reads_fdlite_variables():
    files = _tracked((".py",))
    assert ENVS in files and len(files) > 50
    bad = [v for f in files if f != ENVS for v in python_violations(f)]
    assert not bad, "\n".join(bad)


def test_no_native_source_reads_the_environment():
    files = _tracked(C_SUFFIXES)
    assert any(f.name == "ops_common.cuh" for f in files)
    bad = [v for f in files for v in c_violations(f)]
    assert not bad, "\n".join(bad)


def test_every_variable_has_a_default_and_help():
    assert len(envs.VARIABLES) >= 17
    for name, var in envs.VARIABLES.items():
        assert isinstance(var.default, str), name
        assert isinstance(var.help, str) and len(var.help.strip()) > 10, name
        var.parse(var.default)  # the default is a valid value
    assert "| `FDLITE_CACHE` |" in envs.describe()


def test_every_fdlite_name_the_package_mentions_is_listed():
    names = set()
    for f in _tracked((".py", ".md", *C_SUFFIXES)):
        names |= set(re.findall(r"\bFDLITE_[A-Z0-9_]*[A-Z0-9]\b", f.read_text(errors="replace")))
    names = {n for n in names if not n.endswith("_H")}  # header guards
    assert names and names <= set(envs.VARIABLES), names - set(envs.VARIABLES)


def test_values_are_read_once_until_refresh(monkeypatch):
    monkeypatch.setenv("FDLITE_PDL", "0")  # the suite's monkeypatch refreshes (tests/env_patch.py)
    assert envs.FDLITE_PDL == 0
    os.environ["FDLITE_PDL"] = "1"  # behind the cache's back: still the first read
    assert envs.FDLITE_PDL == 0 and envs.get("FDLITE_PDL") == 0
    envs.refresh("FDLITE_PDL")
    assert envs.FDLITE_PDL == 1
    monkeypatch.delenv("FDLITE_PDL")
    assert envs.FDLITE_PDL == 2  # unset: the default


def test_parsing(monkeypatch):
    monkeypatch.setenv("FDLITE_CUDA_ARCHS", " 90; 100 ;")
    monkeypatch.setenv("FDLITE_GPU_OPS_CHECKS", "0")
    monkeypatch.setenv("FDLITE_CPU_ATTENTION", " Reference ")
    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "")  # empty: the default
    assert envs.FDLITE_CUDA_ARCHS == ["90", "100"]
    assert envs.FDLITE_GPU_OPS_CHECKS is False and envs.FDLITE_GEMV is True
    assert envs.FDLITE_CPU_ATTENTION == "reference"
    assert envs.PADDLE_TRAINERS_NUM == 1
    monkeypatch.setenv("FDLITE_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="FDLITE_CPU_ATTENTION='fast'"):
        envs.FDLITE_CPU_ATTENTION
    monkeypatch.setenv("FDLITE_PDL", "3")
    with pytest.raises(ValueError, match="FDLITE_PDL"):
        envs.FDLITE_PDL
    with pytest.raises(AttributeError):
        envs.FDLITE_NO_SUCH_VARIABLE


def test_gpu_ops_take_their_switches_from_python():
    """ops_capi.cu exports fdl_set_options(int pdl, int gemv, int attn_mma, int decode_mma, int decode_split_keys), gpu.py declares every exported C function with
    the right number of arguments, and both agree on the ABI version."""
    from fdlite.kernels import gpu

    text = _strip_c_comments((PACKAGE / "kernels" / "csrc" / "ops_capi.cu").read_text())
    exported = {m.group(1): [a for a in m.group(2).split(",") if a.strip() not in ("", "void")]
                for m in re.finditer(r"FDL_API\s+[\w\s\*]+?\b(fdl_\w+)\s*\(([^)]*)\)", text)}
    assert set(exported) == set(gpu.CAPI_SIGNATURES)
    for name, params in exported.items():
        assert len(params) == len(gpu.CAPI_SIGNATURES[name][1]), name
    assert exported["fdl_set_options"] == ["int pdl", " int gemv", " int attn_mma", " int decode_mma", " int decode_split_keys"]
    version = re.search(r"fdl_ops_abi_version\(void\)\s*\{\s*return (\d+);", text).group(1)
    assert int(version) == gpu.ABI_VERSION


def test_gpu_switches_reach_the_library_in_order(monkeypatch):
    """`gpu.set_options` hands (pdl, gemv, attn_mma, decode_mma, decode_split_keys) to fdl_set_options in that order, None
    keeping the value from the environment; a value the library refuses is an error naming it."""
    from fdlite.kernels import gpu

    calls = []

    class FakeCapi:  # the checks of ops_capi.cu's fdl_set_options
        def fdl_set_options(self, pdl, gemv, attn_mma, decode_mma, decode_split_keys):
            calls.append((pdl, gemv, attn_mma, decode_mma, decode_split_keys))
            if not 0 <= decode_split_keys <= 4096 or decode_split_keys % 64:
                return 2
            return 0 if 0 <= pdl <= 2 else 1

    monkeypatch.setenv("FDLITE_PDL", "1")
    monkeypatch.setenv("FDLITE_GEMV", "0")
    monkeypatch.setenv("FDLITE_ATTN_MMA", "1")
    monkeypatch.setenv("FDLITE_DECODE_MMA", "1")
    monkeypatch.setenv("FDLITE_DECODE_SPLIT_KEYS", "128")
    envs.refresh()
    monkeypatch.setitem(gpu._state, "path", "fake")
    monkeypatch.setitem(gpu._state, "capi", FakeCapi())
    try:
        gpu.set_options(attn_mma=False)
        gpu.set_options()
        gpu.set_options(pdl=0, gemv=True)
        gpu.set_options(attn_mma=2)
        gpu.set_options(decode_mma=False)
        gpu.set_options(decode_split_keys=256)
        assert calls == [(1, 0, 0, 1, 128), (1, 0, 1, 1, 128), (0, 1, 1, 1, 128), (1, 0, 2, 1, 128),
                         (1, 0, 1, 0, 128), (1, 0, 1, 1, 256)]
        with pytest.raises(gpu.GpuOpsError, match="pdl=5"):
            gpu.set_options(pdl=5)
        with pytest.raises(gpu.GpuOpsError, match="decode_split_keys=96"):
            gpu.set_options(decode_split_keys=96)
    finally:
        monkeypatch.undo()
        envs.refresh()


def test_decode_kernel_switch_is_a_flag_on_by_default(monkeypatch):
    """FDLITE_DECODE_MMA: the tensor-core decode attention kernel by default; 0 / off the CUDA-core one."""
    monkeypatch.delenv("FDLITE_DECODE_MMA", raising=False)
    envs.refresh()
    assert envs.FDLITE_DECODE_MMA is True
    for off in ("0", "off"):
        monkeypatch.setenv("FDLITE_DECODE_MMA", off)
        envs.refresh()
        assert envs.FDLITE_DECODE_MMA is False
    monkeypatch.undo()
    envs.refresh()


def test_attn_kernel_switch_is_zero_one_or_two(monkeypatch):
    """FDLITE_ATTN_MMA picks the prefill attention kernel: 2 (wgmma where it can run) by default, 0 / 1 / 2 accepted,
    anything else refused with the variable's name."""
    monkeypatch.delenv("FDLITE_ATTN_MMA", raising=False)
    envs.refresh()
    assert envs.FDLITE_ATTN_MMA == 2
    monkeypatch.setenv("FDLITE_ATTN_MMA", "1")
    envs.refresh()
    assert envs.FDLITE_ATTN_MMA == 1
    monkeypatch.setenv("FDLITE_ATTN_MMA", "3")
    envs.refresh()
    with pytest.raises(ValueError, match="FDLITE_ATTN_MMA='3'"):
        envs.FDLITE_ATTN_MMA  # noqa: B018
    monkeypatch.undo()
    envs.refresh()


def test_readme_table_is_the_variables_table():
    """README's table of environment variables is `envs.describe()`, so a new variable cannot go undocumented."""
    assert envs.describe() in (ROOT / "README.md").read_text()
