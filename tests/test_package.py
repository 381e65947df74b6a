import subprocess
import sys


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
                                       "PoolingParams"}
    try:
        fxrewrite.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("unknown attribute did not raise")
