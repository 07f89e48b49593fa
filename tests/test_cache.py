"""Tests of the tuning cache (convpass/cache.py): CPU only, fast."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sqlite3
import time
import traceback
from pathlib import Path

import pytest
from conftest import newer_schema_cache

from convpass.cli.cache import add_cache_parser, cache_command
from convpass.core.device import DeviceFingerprint
from convpass.core.problem import ConvShape, ProblemKey
from convpass.tuning.cache import TuningCache
from convpass.tuning.cache_file import default_cache_path
from convpass.tuning.cache_rows import CacheError, CacheWarning, Measurement

H200 = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
H100 = DeviceFingerprint("NVIDIA H100 80GB HBM3", "9.0", 132, 91000)


def shape(n: int = 1, c: int = 64, k: int = 64, direction: str = "fwd") -> ConvShape:
    return ConvShape(direction, n, c, k, (56, 56), (3, 3), (1, 1), (1, 1), (1, 1))  # type: ignore[arg-type]


def meas(key: ProblemKey, algo: str = "implicit_gemm", **kw) -> Measurement:
    fields = dict(
        status="ok", time_ms=0.125, workspace_bytes=1024, deterministic=True,
        measured_at=1_790_000_000.5, method="measure",
    )
    fields.update(kw)
    return Measurement(key=key, algo=algo, **fields)  # type: ignore[arg-type]


def rows(cache: TuningCache) -> list[tuple]:
    with sqlite3.connect(cache.path) as c:
        return sorted(c.execute("SELECT * FROM measurements").fetchall(), key=repr)


@pytest.fixture
def cache(tmp_path: Path):
    with TuningCache(tmp_path / "tuning.db") as c:
        yield c


# -------------------------------------------------------------------------------- put / get


def test_put_get_round_trip_all_fields(cache: TuningCache) -> None:
    key = shape().key("nchw", "default")
    ms = [
        meas(key, "implicit_precomp_gemm", time_ms=0.0625, workspace_bytes=0, deterministic=True,
             note="warm clocks", heuristic_rank=0, find_rank=1),
        meas(key, "fft", status="unsupported", time_ms=None, deterministic=False, note="no fft here"),
        meas(key, "winograd", status="oom", time_ms=None, workspace_bytes=2**40),
        meas(key, "gemm", method="heuristic", time_ms=None, heuristic_rank=3),
        meas(key, "gemm", method="find", time_ms=0.5, find_rank=0),
    ]
    cache.put(H200, ms)
    got = cache.get_key(H200, key)
    assert sorted(got, key=repr) == sorted(ms, key=repr)
    assert cache.get_key(H100, key) == []
    assert cache.get(H200, shape(n=2)) == []
    oom = next(m for m in got if m.algo == "winograd")
    assert oom.time_ms is None and oom.workspace_bytes == 2**40 and oom.status == "oom"
    # ok rows come first, fastest first, within a key and method
    measured = [m for m in got if m.method == "measure"]
    assert measured[0].algo == "implicit_precomp_gemm"


def test_measurement_validation() -> None:
    key = shape().key("nchw", "default")
    with pytest.raises(ValueError, match="status"):
        meas(key, status="great")
    with pytest.raises(ValueError, match="method"):
        meas(key, method="guess")
    with pytest.raises(ValueError, match="time_ms"):
        meas(key, status="error", time_ms=1.0)
    with pytest.raises(ValueError, match="workspace_bytes"):
        meas(key, workspace_bytes=-1)
    assert meas(key, time_ms=1).time_ms == 1.0 and isinstance(meas(key, time_ms=1).time_ms, float)


def test_get_by_shape_spans_layouts_and_math(cache: TuningCache) -> None:
    s = shape(c=32, k=128)
    keys = [s.key(lay, mm) for lay in ("nchw", "nhwc") for mm in ("default", "fma")]
    cache.put(H200, [meas(k, a) for k in keys for a in ("implicit_gemm", "winograd")])
    cache.put(H200, [meas(shape(c=32, k=64).key("nchw", "default"))])  # another geometry
    cache.put(H200, [meas(s.with_direction("dgrad").key("nchw", "default"), "algo_1")])  # other direction
    cache.put(H100, [meas(keys[0])])  # another device
    got = cache.get(H200, s)
    assert len(got) == 8
    assert {m.key for m in got} == set(keys)
    assert len(cache.get(H200, s.with_direction("dgrad"))) == 1


def test_upsert_overwrites(cache: TuningCache) -> None:
    key = shape().key("nhwc", "tensor_op")
    cache.put(H200, [meas(key, time_ms=1.0)])
    cache.put(H200, [meas(key, time_ms=0.5, note="again", measured_at=1_800_000_000.0)])
    cache.put(H200, [meas(key, method="find", time_ms=0.7)])  # another method: its own row
    got = cache.get_key(H200, key)
    assert len(got) == 2
    m = next(g for g in got if g.method == "measure")
    assert (m.time_ms, m.note, m.measured_at) == (0.5, "again", 1_800_000_000.0)


def test_a_new_measurement_can_forget_rows_of_the_one_it_replaces(cache: TuningCache) -> None:
    """A fleet task measuring a geometry again: the earlier task's rows it did not take again (e.g.
    a fused call of an algorithm it did not time) go in the same transaction; other rows of the
    geometry (another run's epilogue), other devices, and everything on a failure, stay."""
    s = shape(c=32, k=128)
    key = s.key("nhwc", "default")
    cache.put(H200, [meas(key, a) for a in ("implicit_gemm", "gemm+bias+relu", "gemm+bias+sigmoid")])
    cache.put(H100, [meas(key, "gemm+bias+relu")])
    with pytest.raises(TypeError):
        cache.put(H200, [meas(key, "winograd"), "not a row"], forget=[(key, "gemm+bias+relu", "measure")])  # type: ignore[list-item]
    assert len(cache.get(H200, s)) == 3
    cache.put(H200, [meas(key, "implicit_gemm", time_ms=0.2)], forget=[(key, "gemm+bias+relu", "measure")])
    assert sorted((m.algo, m.time_ms) for m in cache.get(H200, s)) == [("gemm+bias+sigmoid", 0.125), ("implicit_gemm", 0.2)]
    assert len(cache.get(H100, s)) == 1


def test_devices_stats_clear(cache: TuningCache) -> None:
    k1, k2 = shape().key("nchw", "default"), shape(n=8).key("nchw", "default")
    cache.put(H200, [meas(k1, "a", measured_at=100.0), meas(k1, "b"), meas(k2, "a", measured_at=2e9)])
    cache.put(H100, [meas(k1, "a")])
    assert sorted(cache.devices(), key=str) == sorted([(H200, 2), (H100, 1)], key=str)
    st = cache.stats()
    assert st["path"] == str(cache.path) and st["size_bytes"] > 0
    assert (st["keys"], st["measurements"]) == (3, 4)
    assert (st["oldest_measured_at"], st["newest_measured_at"]) == (100.0, 2e9)
    only = cache.stats(H200)
    assert [d["device"] for d in only["devices"]] == [str(H200)] and only["measurements"] == 3
    assert cache.clear(H100) == 1
    assert cache.devices() == [(H200, 2)]
    assert cache.clear() == 3
    assert cache.devices() == [] and cache.stats()["oldest_measured_at"] is None


# -------------------------------------------------------------------------------- export / import


def _populate(cache: TuningCache) -> None:
    for dev in (H200, H100):
        for n in (1, 32):
            s = shape(n=n)
            cache.put(dev, [
                meas(s.key("nchw", "default"), "implicit_gemm", heuristic_rank=0),
                meas(s.key("nhwc", "fma"), "winograd_nonfused", status="wrong_result", time_ms=None,
                     deterministic=False, note="max err 3e-2", find_rank=4),
                meas(s.with_direction("wgrad").key("nchw", "default"), "algo_0", method="heuristic",
                     time_ms=None, deterministic=False, heuristic_rank=1),
            ])


def test_export_import_round_trip(tmp_path: Path, cache: TuningCache) -> None:
    _populate(cache)
    out = tmp_path / "all.json"
    assert cache.export_json(out) == 12
    doc = json.loads(out.read_text())
    assert doc["format"] == "convpass-tuning-cache" and doc["version"] == 2
    assert isinstance(doc["exported_at"], float) and len(doc["entries"]) == 12
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # temp file replaced

    with TuningCache(tmp_path / "fresh.db") as fresh:
        assert fresh.import_json(out) == 12
        assert rows(fresh) == rows(cache)
        for dev in (H200, H100):
            assert fresh.get(dev, shape(n=32)) == cache.get(dev, shape(n=32))
        again = tmp_path / "again.json"
        fresh.export_json(again)
        assert json.loads(again.read_text())["entries"] == doc["entries"]

    one = tmp_path / "h100.json"
    assert cache.export_json(one, H100) == 6
    assert {e["device"] for e in json.loads(one.read_text())["entries"]} == {str(H100)}


def _good_doc(cache: TuningCache, tmp_path: Path) -> dict:
    _populate(cache)
    cache.put_transpose(H200, (32, 64, 56, 56), "float32", 0.05)
    cache.export_json(tmp_path / "good.json")
    return json.loads((tmp_path / "good.json").read_text())


def _mutations():
    def entry(i, f):
        def mut(doc):
            f(doc["entries"][i])
            return doc
        return mut

    def setk(name, value):
        def f(e):
            e[name] = value
        return f

    return [
        ("not json", lambda doc: "{this is not json", "not valid JSON"),
        ("format tag", lambda doc: {**doc, "format": "something-else"}, "field 'format'"),
        ("version", lambda doc: {**doc, "version": 3}, "field 'version'"),
        ("v1 with transposes", lambda doc: {**doc, "version": 1}, "field 'transposes'"),
        ("transposes not list", lambda doc: {**doc, "transposes": {}}, "field 'transposes'"),
        ("transpose dims", lambda doc: {**doc, "transposes": [{**doc["transposes"][0], "dims": [1, 0, 2]}]}, "transpose 0"),
        ("transpose dtype", lambda doc: {**doc, "transposes": [{**doc["transposes"][0], "dtype": "int8"}]}, "transpose 0"),
        ("transpose time", lambda doc: {**doc, "transposes": [{**doc["transposes"][0], "time_ms": -1}]}, "transpose 0"),
        ("transpose device", lambda doc: {**doc, "transposes": [{**doc["transposes"][0], "device": "H200"}]}, "transpose 0, field 'device'"),
        ("transpose field", lambda doc: {**doc, "transposes": [{**doc["transposes"][0], "colour": 1}]}, "transpose 0"),
        ("entries not list", lambda doc: {**doc, "entries": {}}, "field 'entries'"),
        ("missing field", entry(5, lambda e: e.pop("algo")), "entry 5: missing field 'algo'"),
        ("bad key", entry(7, setk("key", "fwd|n=1|nonsense")), "entry 7, field 'key'"),
        ("bad device", entry(3, setk("device", "H200")), "entry 3, field 'device'"),
        ("bad status", entry(11, setk("status", "great")), "entry 11, field 'status'"),
        ("bad method", entry(2, setk("method", "guess")), "entry 2, field 'method'"),
        ("bad type", entry(4, setk("workspace_bytes", "1024")), "entry 4, field 'workspace_bytes'"),
        ("time without ok", entry(1, lambda e: e.update(status="error", time_ms=1.0)), "entry 1, field 'time_ms'"),
        ("unknown field", entry(6, setk("colour", "red")), "entry 6: unknown field"),
        ("NaN", lambda doc: json.dumps(doc).replace('"time_ms": 0.125', '"time_ms": NaN', 1), "NaN"),
    ]


@pytest.mark.parametrize("name,mutate,where", _mutations(), ids=[m[0] for m in _mutations()])
def test_import_rejects_malformed_and_writes_nothing(tmp_path: Path, cache: TuningCache, name, mutate, where) -> None:
    doc = _good_doc(cache, tmp_path)
    cache.clear()
    keep = meas(shape(n=3).key("nchw", "default"))
    cache.put(H200, [keep])
    before = rows(cache)
    bad = mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(CacheError) as err:
        cache.import_json(path)
    msg = str(err.value)
    assert where in msg and str(path) in msg and "\n" not in msg
    assert rows(cache) == before


def test_transposes_round_trip_export_import_and_clear(tmp_path: Path, cache: TuningCache) -> None:
    assert cache.get_transpose(H200, (32, 64, 56, 56), "float32") is None
    cache.put_transpose(H200, (32, 64, 56, 56), "float32", 0.05)
    cache.put_transpose(H200, (32, 64, 56, 56), "float32", 0.04)  # a re-measurement overwrites
    cache.put_transpose(H200, (1, 64, 56, 56), "float16", 0.003)
    cache.put_transpose(H100, (32, 64, 56, 56), "float32", 0.07)
    assert cache.get_transpose(H200, [32, 64, 56, 56], "float32") == 0.04
    assert cache.get_transpose(H200, (32, 64, 56, 56), "float16") is None
    assert cache.stats()["transposes"] == 3 and cache.stats(H100)["transposes"] == 1
    with pytest.raises(ValueError, match="dtype"):
        cache.put_transpose(H200, (1, 2, 3, 4), "int8", 0.1)
    with pytest.raises(ValueError, match="time_ms"):
        cache.put_transpose(H200, (1, 2, 3, 4), "float32", float("nan"))

    cache.export_json(tmp_path / "h200.json", H200)
    doc = json.loads((tmp_path / "h200.json").read_text())
    assert doc["transposes"] == [
        {"device": str(H200), "dims": [1, 64, 56, 56], "dtype": "float16", "time_ms": 0.003, "measured_at": doc["transposes"][0]["measured_at"]},
        {"device": str(H200), "dims": [32, 64, 56, 56], "dtype": "float32", "time_ms": 0.04, "measured_at": doc["transposes"][1]["measured_at"]},
    ]
    with TuningCache(tmp_path / "fresh.db") as fresh:
        fresh.import_json(tmp_path / "h200.json")
        assert fresh.get_transpose(H200, (32, 64, 56, 56), "float32") == 0.04
        assert fresh.get_transpose(H100, (32, 64, 56, 56), "float32") is None

    cache.clear(H200)
    assert cache.get_transpose(H200, (32, 64, 56, 56), "float32") is None
    assert cache.get_transpose(H100, (32, 64, 56, 56), "float32") == 0.07


def test_version_1_export_still_imports(tmp_path: Path, cache: TuningCache) -> None:
    _populate(cache)
    cache.export_json(tmp_path / "v2.json")
    doc = json.loads((tmp_path / "v2.json").read_text())
    doc["version"] = 1
    del doc["transposes"]
    (tmp_path / "v1.json").write_text(json.dumps(doc))
    with TuningCache(tmp_path / "fresh.db") as fresh:
        assert fresh.import_json(tmp_path / "v1.json") == 12
        assert rows(fresh) == rows(cache)


def test_schema_version_1_file_is_upgraded_in_place(tmp_path: Path, recwarn) -> None:
    """A cache written before transposes were recorded keeps its measurements and gains the table."""
    path = tmp_path / "v1.db"
    key = shape().key("nchw", "default")
    with TuningCache(path) as c:
        c.put(H200, [meas(key)])
    with sqlite3.connect(path) as c:  # as schema version 1 wrote it
        c.execute("DROP TABLE transposes")
        c.execute("DROP TABLE fusion_timings")
        c.execute("UPDATE meta SET value = '1' WHERE name = 'schema_version'")
    c.close()
    with TuningCache(path) as c:
        assert c.get_key(H200, key) == [meas(key)]
        c.put_transpose(H200, (1, 3, 8, 8), "float32", 0.001)
        assert c.get_transpose(H200, (1, 3, 8, 8), "float32") == 0.001
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone() == ("3",)
    c.close()
    assert not [w for w in recwarn.list if issubclass(w.category, CacheWarning)]
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_schema_version_2_file_gains_the_fusion_timings(tmp_path: Path) -> None:
    """A cache written before fusion units were timed keeps everything and gains their table; a
    read-only open changes nothing and answers "none recorded"."""
    path = tmp_path / "v2.db"
    key = shape().key("nchw", "default")
    with TuningCache(path) as c:
        c.put(H200, [meas(key)])
        c.put_transpose(H200, (1, 3, 8, 8), "float32", 0.001)
    with sqlite3.connect(path) as c:  # as schema version 2 wrote it
        c.execute("DROP TABLE fusion_timings")
        c.execute("UPDATE meta SET value = '2' WHERE name = 'schema_version'")
    c.close()
    before = path.read_bytes()
    with TuningCache(path, readonly=True) as c:
        assert c.get_fusion(H200, "sig") is None and c.get_transpose(H200, (1, 3, 8, 8), "float32") == 0.001
    assert path.read_bytes() == before
    with TuningCache(path) as c:
        assert c.get_key(H200, key) == [meas(key)]
        c.put_fusion(H200, "sig", {"fused_nchw": 0.1, "unfused_nchw": 0.2})
        assert c.get_fusion(H200, "sig") == {"fused_nchw": 0.1, "unfused_nchw": 0.2} and c.get_fusion(H100, "sig") is None


def test_import_missing_file(tmp_path: Path, cache: TuningCache) -> None:
    with pytest.raises(CacheError, match="cannot read"):
        cache.import_json(tmp_path / "nope.json")


def test_export_to_missing_dir(tmp_path: Path, cache: TuningCache) -> None:
    with pytest.raises(CacheError, match="does not exist"):
        cache.export_json(tmp_path / "no" / "such" / "dir.json")


# -------------------------------------------------------------------------------- damaged files


def _assert_moved_aside(path: Path, original: bytes, recwarn_list) -> None:
    asides = sorted(path.parent.glob(path.name + ".corrupt-*"))
    asides = [a for a in asides if not a.name.endswith(("-wal", "-shm"))]
    assert len(asides) == 1, asides
    assert asides[0].read_bytes() == original
    msgs = [str(w.message) for w in recwarn_list if issubclass(w.category, CacheWarning)]
    assert len(msgs) == 1 and str(path) in msgs[0] and str(asides[0]) in msgs[0]


def _check_fresh_cache_works(path: Path) -> None:
    with TuningCache(path) as c:
        key = shape().key("nchw", "default")
        c.put(H200, [meas(key)])
        assert c.get_key(H200, key) == [meas(key)]


def _damage_cases(tmp_path: Path) -> dict[str, bytes]:
    """name -> bytes of a damaged cache file."""
    out = {}
    out["garbage"] = os.urandom(3000) + b"this is not an sqlite database"

    real = tmp_path / "real.db"
    with TuningCache(real) as c:
        c.put(H200, [meas(shape(n=n).key("nchw", "default"), f"algo_{a}", note="x" * 50)
                     for n in range(1, 60) for a in range(6)])
    data = real.read_bytes()
    out["truncated"] = data[: len(data) // 2]

    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        c.execute("INSERT INTO users VALUES (1, 'ada')")
    out["foreign"] = foreign.read_bytes()

    newer = tmp_path / "newer.db"
    newer_schema_cache(newer)
    out["schema_version"] = newer.read_bytes()
    return out


def test_a_damaged_cache_is_moved_aside(tmp_path: Path) -> None:
    data = _damage_cases(tmp_path / "src")["truncated"]
    path = tmp_path / "tuning.db"
    path.write_bytes(data)
    with pytest.raises(CacheError, match="is damaged .* refused, nothing was changed"):
        TuningCache(path, readonly=True)  # reading changes nothing
    assert path.read_bytes() == data and not list(tmp_path.glob("*.corrupt-*"))
    with pytest.warns(CacheWarning) as rec:
        c = TuningCache(path)
    c.close()
    _assert_moved_aside(path, data, rec.list)
    _check_fresh_cache_works(path)


@pytest.mark.parametrize("name,match", [("garbage", "not a convpass tuning cache"), ("foreign", "another program's SQLite database"),
                                        ("schema_version", "written by a newer convpass")])
@pytest.mark.parametrize("readonly", [False, True])
def test_a_file_that_is_no_cache_of_ours_is_refused_unchanged(tmp_path: Path, name: str, match: str, readonly: bool) -> None:
    data = _damage_cases(tmp_path / "src")[name]
    path = tmp_path / "tuning.db"
    path.write_bytes(data)
    before = (path.stat().st_mtime_ns, sorted(p.name for p in tmp_path.iterdir()))
    with pytest.raises(CacheError, match=match + ".*refused, nothing was changed"):
        TuningCache(path, readonly=readonly)
    assert path.read_bytes() == data
    assert (path.stat().st_mtime_ns, sorted(p.name for p in tmp_path.iterdir())) == before


def test_empty_file_is_a_fresh_cache(tmp_path: Path, recwarn) -> None:
    path = tmp_path / "tuning.db"
    path.write_bytes(b"")
    _check_fresh_cache_works(path)
    assert not [w for w in recwarn.list if issubclass(w.category, CacheWarning)]
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_unwritable_location(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("I am a file")
    with pytest.raises(CacheError, match="cannot create the tuning cache directory"):
        TuningCache(blocker / "sub" / "tuning.db")
    with pytest.raises(CacheError, match="is a directory"):
        TuningCache(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_read_only_location(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(CacheError, match="writ"):
            TuningCache(ro / "tuning.db")
    finally:
        ro.chmod(0o700)


# -------------------------------------------------------------------------------- concurrency


def _writer(path: str, worker: int, count: int, batch: int, start, results) -> None:
    try:
        dev = DeviceFingerprint("NVIDIA H200", "9.0", 132, 91900)
        with TuningCache(path) as c:
            start.wait(30)  # all workers start writing together
            for i in range(0, count, batch):
                ms = [
                    Measurement(shape(n=j + 1).key("nchw", "default"), f"algo_w{worker}", "ok", 0.1 + j,
                                0, True, time.time(), "measure")
                    for j in range(i, min(i + batch, count))
                ]
                c.put(dev, ms)
                if i % 20 == 0:
                    c.get(dev, shape(n=i + 1))
        results.put((worker, "ok"))
    except BaseException:  # noqa: BLE001
        results.put((worker, traceback.format_exc()))


def test_concurrent_writers(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.db")
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(path, w, 200, 2, start, results)) for w in range(4)]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert outcomes == {w: "ok" for w in range(4)}, outcomes
    assert all(p.exitcode == 0 for p in procs)
    with TuningCache(path) as c:
        assert c.stats()["measurements"] == 800
        assert c.devices() == [(H200, 200)]
        assert {m.algo for m in c.get(H200, shape(n=200))} == {f"algo_w{w}" for w in range(4)}


def _open_damaged(path: str, start, results) -> None:
    try:
        import warnings

        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            start.wait(30)
            with TuningCache(path) as c:
                c.put(H200, [meas(shape(n=os.getpid() % 5000 + 1).key("nchw", "default"))])
        results.put(("ok", sum(issubclass(w.category, CacheWarning) for w in rec)))
    except BaseException:  # noqa: BLE001
        results.put(("error", traceback.format_exc()))


def test_a_cache_moved_aside_between_the_look_and_the_check_is_opened_as_absent(tmp_path: Path, monkeypatch) -> None:
    """Another process moves a damaged cache aside after this one saw the path and before it
    checked the file: not an error, the open starts (or opens) the fresh cache."""
    from convpass.tuning import cache_file

    path = tmp_path / "shared.db"
    path.write_bytes(_damage_cases(tmp_path / "src")["truncated"])
    real = cache_file.check_readable

    def moved_meanwhile(p, what):
        os.replace(p, f"{p}.corrupt-elsewhere")
        return real(p, what)

    monkeypatch.setattr(cache_file, "check_readable", moved_meanwhile)
    with TuningCache(path) as c:
        c.put(H200, [meas(shape(n=7).key("nchw", "default"))])
        assert c.stats()["measurements"] == 1


def test_concurrent_open_of_damaged_file(tmp_path: Path) -> None:
    """Processes that find the same damaged file at once: one moves it aside, all end up writing."""
    path = tmp_path / "shared.db"
    original = _damage_cases(tmp_path / "src")["truncated"]
    path.write_bytes(original)
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_open_damaged, args=(str(path), start, results)) for _ in range(4)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert [o[0] for o in outcomes] == ["ok"] * 4, outcomes
    assert sum(o[1] for o in outcomes) == 1
    asides = [a for a in tmp_path.glob("shared.db.corrupt-*") if not a.name.endswith(("-wal", "-shm"))]
    assert len(asides) == 1
    assert asides[0].read_bytes() == original  # the damaged file, not a fresh cache moved over it
    with TuningCache(path) as c:
        assert c.stats()["measurements"] == 4


def test_damage_found_while_in_use_is_repaired(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path / "tuning.db")
    real = cache._conn

    class Broken:
        def execute(self, *a, **k):
            raise sqlite3.DatabaseError("database disk image is malformed")

        def close(self):
            real.close()

        in_transaction = False

    cache._conn = Broken()  # type: ignore[assignment]
    key = shape().key("nchw", "default")
    with pytest.warns(CacheWarning, match="damaged while in use"):
        cache.put(H200, [meas(key)])
    assert cache.get_key(H200, key) == [meas(key)]
    assert len(list(tmp_path.glob("tuning.db.corrupt-*"))) >= 1
    cache.close()


def test_repair_in_use_never_moves_a_replacement(tmp_path: Path, recwarn) -> None:
    """Damage found on a file another process already replaced: the replacement is left alone."""
    path = tmp_path / "tuning.db"
    cache = TuningCache(path)
    cache._conn.close()  # type: ignore[union-attr]

    class Broken:
        def execute(self, *a, **k):
            raise sqlite3.DatabaseError("database disk image is malformed")

        def close(self):
            pass

        in_transaction = False

    cache._conn = Broken()  # type: ignore[assignment]
    os.replace(path, tmp_path / "elsewhere.db")  # what another process's move-aside does...
    other = shape(n=7).key("nchw", "default")
    with TuningCache(path) as fresh:  # ...before it starts a fresh cache and writes to it
        fresh.put(H200, [meas(other)])
    key = shape().key("nchw", "default")
    cache.put(H200, [meas(key)])
    assert cache.get_key(H200, other) == [meas(other)] and cache.get_key(H200, key) == [meas(key)]
    assert not list(tmp_path.glob("tuning.db.corrupt-*"))
    assert not [w for w in recwarn.list if issubclass(w.category, CacheWarning)]
    cache.close()


# -------------------------------------------------------------------------------- resolve_device


def test_resolve_device(cache: TuningCache) -> None:
    h100_pcie = DeviceFingerprint("NVIDIA H100 PCIe", "9.0", 114, 91900)
    h200_nvl = DeviceFingerprint("NVIDIA H200 NVL", "9.0", 132, 91900)
    keys = [shape(n=n).key("nchw", "default") for n in range(1, 5)]
    cache.put(H100, [meas(k) for k in keys[:3]])  # old cuDNN, more keys
    cache.put(h100_pcie, [meas(keys[0])])  # newest cuDNN
    cache.put(H200, [meas(k) for k in keys[:2]])
    cache.put(h200_nvl, [meas(keys[0])])

    assert cache.resolve_device(str(H100)) == H100  # exact fingerprint wins
    assert cache.resolve_device(str(H100).upper()) == H100
    assert cache.resolve_device("h100") == h100_pcie  # newest cuDNN first
    assert cache.resolve_device("H200") == H200  # same cuDNN: most keys
    assert cache.resolve_device("nvl") == h200_nvl
    with pytest.raises(CacheError) as err:
        cache.resolve_device("A100")
    assert "A100" in str(err.value) and str(H100) in str(err.value) and str(h200_nvl) in str(err.value)

    twin = DeviceFingerprint("NVIDIA H200 SXM", "9.0", 132, 91900)
    cache.put(twin, [meas(k) for k in keys[:2]])
    with pytest.raises(CacheError, match="ambiguous"):
        cache.resolve_device("H200")


def test_resolve_device_empty_cache(cache: TuningCache) -> None:
    with pytest.raises(CacheError, match="empty"):
        cache.resolve_device("H200")


# -------------------------------------------------------------------------------- default path


def test_default_path_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CONVPASS_CACHE", str(tmp_path / "env" / "c.db"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_path() == tmp_path / "env" / "c.db"
    with TuningCache() as c:
        assert c.path == tmp_path / "env" / "c.db" and c.path.exists()

    monkeypatch.delenv("CONVPASS_CACHE")
    assert default_cache_path() == tmp_path / "xdg" / "convpass" / "tuning.db"
    with TuningCache() as c:
        assert c.path.exists()

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_path() == tmp_path / "home" / ".cache" / "convpass" / "tuning.db"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored, per the XDG spec
    assert default_cache_path() == tmp_path / "home" / ".cache" / "convpass" / "tuning.db"


# -------------------------------------------------------------------------------- CLI


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="convpass")
    sub = parser.add_subparsers(dest="command", required=True)
    add_cache_parser(sub)
    args = parser.parse_args(["cache", *argv])
    assert args.func is cache_command
    return cache_command(args)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps the table at 80 columns otherwise
    db = str(tmp_path / "c.db")
    with TuningCache(db) as c:
        _populate(c)

    assert _cli("stats", "--cache", db) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out and "NVIDIA H100 80GB HBM3" in out and "9.19.0" in out and db in out

    assert _cli("stats", "--cache", db, "--json", "--device-name", "h200") == 0
    st = json.loads(capsys.readouterr().out)
    assert [d["device"] for d in st["devices"]] == [str(H200)] and st["measurements"] == 6

    exported = tmp_path / "h200.json"
    assert _cli("export", str(exported), "--cache", db, "--device-name", "H200") == 0
    assert "exported 6" in capsys.readouterr().out
    db2 = str(tmp_path / "c2.db")
    assert _cli("import", str(exported), "--cache", db2) == 0
    assert "imported 6" in capsys.readouterr().out
    with TuningCache(db2) as c2:
        assert c2.devices() == [(H200, 6)]

    assert _cli("clear", "--cache", db, "--device-name", "H100") == 0
    assert "cleared 6" in capsys.readouterr().out
    with pytest.raises(CacheError, match="needs --device-name NAME .* or --all"):
        _cli("clear", "--cache", db)
    with pytest.raises(CacheError, match="empty"):
        _cli("clear", "--cache", db, "--device-name", "")
    assert _cli("clear", "--cache", db, "--all") == 0
    out = capsys.readouterr().out
    assert "cleared 6" in out and "all devices" in out
    assert _cli("stats", "--cache", db) == 0
    assert "no measurements" in capsys.readouterr().out

    with pytest.raises(CacheError, match="needs a FILE"):
        _cli("export", "--cache", db)
    with pytest.raises(CacheError, match="takes no FILE"):
        _cli("stats", "x.json", "--cache", db)
    with pytest.raises(CacheError, match="no device matching"):
        _cli("clear", "--cache", db2, "--device-name", "A100")
    with pytest.raises(CacheError, match="cannot read"):
        _cli("import", str(tmp_path / "missing.json"), "--cache", db2)
