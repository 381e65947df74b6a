import os
import subprocess
import sys
from pathlib import Path


def test_import_is_light():
    """`import fxrewrite` must not pull in the engine, the server or FastAPI (DESIGN.md: lazy LLM)."""
    code = (
        "import sys, fxrewrite\n"
        "heavy = [m for m in ('fxrewrite.runtime', 'fastapi', 'uvicorn') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_surface_is_small():
    import fxrewrite

    assert set(fxrewrite.__all__) == {"optimize", "explain", "LLM", "SamplingParams", "StructuredOutputsParams",
                                       "PoolingParams", "RequestOutputKind", "TextPrompt", "TokensPrompt"}
    assert all(getattr(fxrewrite, name) is not None for name in fxrewrite.__all__)  # each one resolves
    try:
        fxrewrite.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("unknown attribute did not raise")


def test_checkout_kernels_folder_does_not_shadow_the_installed_kernels_package(tmp_path):
    """Run from this checkout's root (on sys.path first), `import kernels` finds the kernels/ folder (fxrewrite.kernels);
    it must hand over to Hugging Face's installed `kernels` package, which transformers >= 5.25 imports at load (a
    stand-in package here, found after the root), and stay itself when none is installed."""
    root = Path(__file__).resolve().parents[1]
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "__init__.py").write_text("CUDAProperties = 'installed'\n")
    (fake / "layer.py").write_text("LAYER = 1\n")
    code = ("import kernels, fxrewrite.kernels as ours\nfrom kernels import CUDAProperties\nfrom kernels.layer import "
            "LAYER\nprint(kernels.__file__, CUDAProperties, LAYER, ours.__file__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, check=True).stdout.split()
    assert out[:3] == [str(fake / "__init__.py"), "installed", "1"] and out[3] == str(root / "kernels" / "__init__.py")
    alone = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.strip()
    installed = subprocess.run([sys.executable, "-c", "import importlib.util as u; s = u.find_spec('kernels'); "
                                "print(s and s.origin)"], cwd=tmp_path.parent, capture_output=True, text=True).stdout
    if installed.strip() in ("", "None"):  # no kernels package installed: the folder stays what it is
        assert alone == str(root / "kernels" / "__init__.py")
    else:  # transformers >= 5.25's dependency: handed over
        assert alone != str(root / "kernels" / "__init__.py")


def test_checkout_reached_through_a_link_too_does_not_recurse(tmp_path):
    """The checkout on sys.path twice, once through a symbolic link: the hand-over must not find this folder again
    under the other spelling (it recursed until RecursionError)."""
    root = Path(__file__).resolve().parents[1]
    link = tmp_path / "checkout"
    link.symlink_to(root)
    run = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=root,
                         env={**os.environ, "PYTHONPATH": str(link)}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    found = os.path.realpath(run.stdout.strip())  # none installed: the folder itself; else the installed package
    assert found == str(root / "kernels" / "__init__.py") or not found.startswith(str(root / "kernels") + os.sep)
