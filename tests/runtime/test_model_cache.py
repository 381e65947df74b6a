"""The model-folder cache (`runtime/model_files/model_cache.py`): a folder built from a source file is built again
when that file changes in place, even where the sampled content key stays the same (fresh-user report: a GGUF file
edited between the key's samples, converted, then restored, kept being served the edited conversion)."""

import os

from fxrewrite.runtime.model_files.model_cache import cached_build, file_key, read_build_info


def _source(path, fill: bytes) -> None:
    path.write_bytes(b"GGUF" + fill * (6 << 20))  # 6 MiB: the key reads its head, tail and 32 blocks of the rest


def _build_counting(builds):
    def build(out):
        builds.append(out)
        (out / "weights").write_bytes(b"w%d" % len(builds))
    return build


def test_a_source_changed_between_the_key_samples_is_built_again(tmp_path):
    source, builds = tmp_path / "m.gguf", []
    _source(source, b"\0")
    key = file_key(source)
    first = cached_build("m", key, _build_counting(builds), root=tmp_path / "cache", source=source)
    assert (first / "weights").read_bytes() == b"w1" and read_build_info(first)["source"] == str(source.resolve())
    data = bytearray(source.read_bytes())
    middle = len(data) - 2 * (1 << 20)  # file_key: the head and tail MiB, 32 blocks of 64 KiB evenly over the rest
    data[(1 << 20) + middle * 10 // 32 + (1 << 16) + 1000] ^= 0xFF  # just after block 10: between two samples
    source.write_bytes(bytes(data))
    os.utime(source, ns=(0, 123456789))  # an edit moves the mtime
    assert file_key(source) == key
    again = cached_build("m", key, _build_counting(builds), root=tmp_path / "cache", source=source)
    assert again == first and (again / "weights").read_bytes() == b"w2" and len(builds) == 2


def test_a_source_touched_but_unchanged_is_hashed_once_and_not_built_again(tmp_path):
    source, builds = tmp_path / "m.gguf", []
    _source(source, b"\1")
    key = file_key(source)
    folder = cached_build("m", key, _build_counting(builds), root=tmp_path / "cache", source=source)
    os.utime(source, ns=(0, 987654321))
    assert cached_build("m", key, _build_counting(builds), root=tmp_path / "cache", source=source) == folder
    assert len(builds) == 1 and read_build_info(folder)["source_mtime_ns"] == 987654321


def test_a_copy_elsewhere_reuses_the_build(tmp_path):
    """The key is the content's, not the path's: the same file in another virtual environment is not converted
    again."""
    source, builds = tmp_path / "a.gguf", []
    _source(source, b"\2")
    copy = tmp_path / "b.gguf"
    copy.write_bytes(source.read_bytes())
    folder = cached_build("m", file_key(source), _build_counting(builds), root=tmp_path / "cache", source=source)
    assert cached_build("m", file_key(copy), _build_counting(builds), root=tmp_path / "cache", source=copy) == folder
    assert len(builds) == 1
