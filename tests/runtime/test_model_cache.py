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
    verified = read_build_info(folder)["verified"]
    assert len(builds) == 1 and [str(source.resolve()), 6 * (1 << 20) + 4, 987654321] in verified


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


def test_another_paths_file_of_other_bytes_is_not_served_the_build(tmp_path):
    """Final fresh user: the folder of a file edited in place and rebuilt was then served to the pristine file of
    another virtual environment (same name and sampled key, another path: only the recorded path was checked)."""
    pristine, builds = tmp_path / "a.gguf", []
    _source(pristine, b"\3")
    edited = tmp_path / "b.gguf"
    data = bytearray(pristine.read_bytes())
    middle = len(data) - 2 * (1 << 20)
    data[(1 << 20) + middle * 5 // 32 + (1 << 16) + 7] ^= 0xFF
    edited.write_bytes(bytes(data))
    key = file_key(pristine)
    assert file_key(edited) == key
    cached_build("m", key, _build_counting(builds), root=tmp_path / "cache", source=edited)
    folder = cached_build("m", key, _build_counting(builds), root=tmp_path / "cache", source=pristine)
    assert len(builds) == 2 and read_build_info(folder)["source"] == str(pristine.resolve())


def test_threads_verifying_sources_at_once_leave_a_valid_record(tmp_path):
    """Recheck helper: threads of one process shared one temporary record file (named by the pid): some raised
    FileNotFoundError and the record could be left as invalid JSON, breaking the cache for good."""
    from concurrent.futures import ThreadPoolExecutor

    builds, copies = [], []
    for i in range(6):
        copies.append(tmp_path / f"c{i}.gguf")
        _source(copies[-1], b"\4")
    key = file_key(copies[0])
    cached_build("m", key, _build_counting(builds), root=tmp_path / "cache", source=copies[0])
    for round_ in range(3):
        for c in copies:
            os.utime(c, ns=(0, 10**9 * (round_ + 1)))
        with ThreadPoolExecutor(6) as pool:
            folders = list(pool.map(lambda c: cached_build("m", key, _build_counting(builds), root=tmp_path / "cache",
                                                           source=c), copies))
        assert len(set(folders)) == 1 and len(builds) == 1
        assert read_build_info(folders[0])["source_sha256"]  # valid JSON
