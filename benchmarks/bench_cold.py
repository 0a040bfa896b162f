"""The everyday job's cold start: one end-to-end run of ``jobs/train_flux.py`` broken down by phase, cold (empty
cache) and warm (the cache reused), and the wall time each extra training step adds.

    python benchmarks/bench_cold.py [--images 32] [--resolution 256] [--steps 40] [--rounds 3]
                                    [--code DIR ...] [--slope 8] [--from WORK_DIR]
                                    [--simpletuner PYTHON] [--cold-only] [--floor]

The job as a user runs it with its defaults except: ``--images`` generated captioned images (the demo's shapes and
sizes, repeated), ``data.resolution``, ``train.max_steps``, one worker, ``run.ray_address=local`` (its own Ray).
Rank 4, batch 1 and the tiny FLUX.1 model are the job's defaults. The phases come from the run's ledger, the cache
manifest's pass times and ``RAYFLUX_PHASES`` marks (:mod:`rayflux.phases`) written by the driver and the worker;
each phase's start and end are seconds from the process's launch, so phases that overlap (the worker group started
during the cache stage, :mod:`rayflux.train.early`) show it.

``--code DIR`` (repeatable) runs each checkout's job side by side with this tree's, alternating within every round,
and prints each one's median end-to-end time and its ratio to the first (older checkouts have no phase marks; their
totals still compare). ``--slope N``: also time each code's train stage with ``train.max_steps=N`` on the warm cache,
so ``(stage(steps) - stage(N)) / (steps - N)`` is the wall each extra step adds, against the step log's mean
``step_time``.

``--simpletuner PYTHON`` also runs SimpleTuner 4.10.1 on the same images under that interpreter (its venv and what
is configured alike: :mod:`simpletuner_side`), alternating with this tree within every round, and prints each
measure's median per side and the per-round ratio rayflux ÷ SimpleTuner. ``--cold-only`` skips the warm runs. Every
run is measured by :mod:`proctree`: wall to exit, CPU seconds of the whole process tree (orphaned helpers reaped),
terminal lines; cache bytes per image after the cold run. CI never runs the SimpleTuner side.

``--floor`` also runs :mod:`ray_floor` in every round (Ray, with ``--cold`` one actor pool that imports an encoder's
libraries, a ``TorchTrainer`` whose worker imports the train step's libraries and returns): no data, no weights, no
steps. Its wall time bounds from below any job built on those parts, so ``floor ÷ SimpleTuner`` says which targets
this design can reach on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from proctree import run_measured, tree_bytes

ROOT = Path(__file__).resolve().parents[1]

# (label, start, end) over the named times of one run; a name "a|b" is the first of them the run has (an older
# checkout lacks the marks of the early worker group). A run missing a side leaves the row empty.
PHASES = [
    ("python start, imports, config", "launch", "ray_start"),
    ("Ray start", "ray_start", "ray_ready"),
    ("checks before the cache (and the group's launch)", "ray_ready", "discover_start"),
    ("cache stage (discovery to commit)", "cache_start|discover_start", "cache_end|committed"),
    ("  discovery", "discover_start", "discover_end"),
    ("  staging, text input", "discover_end", "passes_start"),
    ("  text pass", "text_start", "text_end"),
    ("  image pass", "images_start", "images_end"),
    ("  both passes (union)", "passes_start", "passes_end"),
    ("  index + commit", "passes_end", "committed"),
    ("worker group start", "train_launch|train_start", "worker_start"),
    ("model load + LoRA", "model_load_start", "model_load_end"),
    ("workers wait for the generation", "handoff_wait_start", "handoff_wait_end"),
    ("cache end -> generation handed over", "cache_end", "handoff"),
    ("first read (feed start)", "handoff_wait_end|worker_start", "first_read_end"),
    ("first step", "step_start", "step_end"),
    ("remaining steps", "step_end", "last_step_end"),
    ("after the last step: fit's end", "last_step_end", "train_end"),
    ("export", "export_start", "export_end"),
    ("exit", "export_end", "exit"),
    ("time to first step", "launch", "step_end"),
    ("Ray start -> export end", "ray_start", "export_end"),
    ("end to end", "launch", "exit"),
]


def write_images(path: Path, n: int) -> Path:
    """``n`` captioned demo images (the demo's 8 sizes, repeated; distinct seeds, so distinct pictures)."""
    from rayflux.testing.images import DEMO_SIZES
    from rayflux.testing.images import write_images as write

    if not (path / ".complete").exists():
        path.mkdir(parents=True, exist_ok=True)
        sizes = (DEMO_SIZES * (n // len(DEMO_SIZES) + 1))[:n]
        write(path, sizes)
        (path / ".complete").write_text(str(n))
    return path


def run_job(code: Path, out: Path, settings: list[str], timeout: float = 1800) -> dict:
    """Run ``code``'s job into ``out``; the named Unix times of its phases, ``steps``, ``step_time``, and its whole
    process tree's ``cpu`` seconds and terminal ``lines`` (:mod:`proctree`)."""
    marks = out.parent / f"{out.name}.phases.jsonl"
    argv = [sys.executable, str(code / "jobs" / "train_flux.py")]
    for s in [f"run.output_dir={out}", *settings]:
        argv += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(code), "TRANSFORMERS_VERBOSITY": "error", "RAYFLUX_PHASES": str(marks)}
    m = run_measured(argv, env, code, out.parent / f"{out.name}.log", timeout)
    if m.returncode != 0:
        raise SystemExit(f"job failed ({' '.join(settings)}): {m.tail}")
    saved = {"launch": m.launch, "exit": m.exit, "cpu": m.cpu, "cpu_rusage": m.cpu_rusage, "lines": m.lines}
    (out.parent / f"{out.name}.times.json").write_text(json.dumps(saved))
    return read_run(out)


def read_run(out: Path) -> dict:
    """The named Unix times of the finished run in ``out`` (its marks, ledger and manifest), ``steps``, ``step_time``
    and, from the marks of every step, the mean ``compute`` (inside ``train_step``) and ``between`` (the loop's own
    work between two steps)."""
    marks = out.parent / f"{out.name}.phases.jsonl"
    saved = out.parent / f"{out.name}.times.json"
    times = json.loads(saved.read_text()) if saved.exists() else {}
    starts, ends = [], []
    if marks.exists():
        for line in marks.read_text().splitlines():
            rec = json.loads(line)
            times.setdefault(rec["phase"], rec["time"])  # the first of each (the first worker's, the first step)
            times[f"last_{rec['phase']}"] = rec["time"]
            {"step_start": starts, "step_end": ends}.get(rec["phase"], []).append(rec["time"])
    if len(starts) > 2 and len(starts) == len(ends):
        # Per step after the first: inside LoraTrainer.train_step, and the loop's own work between two of them.
        times["compute"] = statistics.mean(e - s for s, e in zip(starts[1:], ends[1:]))
        times["between"] = statistics.mean(s - e for e, s in zip(ends[1:], starts[2:]))
    stages = {s["name"]: s for s in json.loads((out / "ledger.json").read_text())["stages"]}
    for name, key in (("train:seg0", "train"), ("export", "export")):
        times[f"{key}_start"], times[f"{key}_end"] = stages[name]["start"], stages[name]["end"]
    cache = stages["cache:g0"]
    times["cache_reused"] = bool(cache.get("reused"))
    manifest_path = Path(cache["dir"], "manifest.json")  # gone once the benchmark removed that cache
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if manifest and not times["cache_reused"]:
        passes = manifest.get("passes", {})
        for k in ("text", "images"):
            if k in passes:
                times[f"{k}_start"], times[f"{k}_end"] = passes[k]["start"], passes[k]["end"]
        if "text_start" in times and "images_start" in times:
            times["passes_start"] = min(times["text_start"], times["images_start"])
            times["passes_end"] = max(times["text_end"], times["images_end"])
        times["committed"] = manifest["committed_at"]
    else:
        times["committed"] = cache["end"]
    steps = [json.loads(x) for x in (out / "metrics" / "steps.jsonl").read_text().splitlines() if x.strip()]
    times["steps"] = len(steps)
    times["step_time"] = statistics.mean(s["step_time"] for s in steps[1:]) if len(steps) > 1 else 0.0
    return times


def _at(run: dict, names: str) -> float | None:
    """The time of the first of ``names`` ("a|b") that ``run`` has."""
    return next((run[n] for n in names.split("|") if n in run), None)


def phase_rows(runs: list[dict]) -> list[tuple[str, float | None, float | None, float | None]]:
    """Each phase's start and end (seconds from the launch) and length, medians over ``runs`` (None where a run
    lacks one of its ends)."""
    rows = []
    for label, a, b in PHASES:
        spans = [(_at(r, a), _at(r, b), r["launch"]) for r in runs if "launch" in r]
        spans = [(s - t0, e - t0) for s, e, t0 in spans if s is not None and e is not None]
        if not spans:
            rows.append((label, None, None, None))
            continue
        med = statistics.median
        rows.append((label, med(s for s, _ in spans), med(e for _, e in spans), med(e - s for s, e in spans)))
    return rows


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--code", type=Path, action="append", default=[], help="another checkout to run side by side")
    ap.add_argument("--slope", type=int, default=0, help="also time train.max_steps=N runs on the warm cache")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument(
        "--simpletuner",
        type=Path,
        default=None,
        metavar="PYTHON",
        help="also run SimpleTuner under this interpreter, alternating with rayflux (simpletuner_side.py)",
    )
    ap.add_argument("--cold-only", action="store_true", help="no warm runs (with --simpletuner: the 200-image check)")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also run ray_floor.py (Ray, one actor pool, a no-op TorchTrainer) in every round, alternating",
    )
    ap.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=None,
        help="only report on the runs an earlier call left in this --work folder",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    work = args.work or Path(tempfile.mkdtemp(prefix="rayflux-bench-cold-"))
    images = write_images(work / f"images-{args.images}", args.images)
    epochs = -(-args.steps // args.images) + 1
    common = [
        f"data.images_dir={images}",
        f"data.resolution={args.resolution}",
        "train.workers.num_workers=1",
        f"train.epochs={epochs}",
        "run.ray_address=local",
    ]
    codes = [ROOT, *[c.resolve() for c in args.code]]
    results: dict[str, dict[str, list[dict]]] = {str(c): {"cold": [], "warm": [], "short": []} for c in codes}
    st = None
    floor: dict[str, list[dict]] = {"cold": [], "warm": []}
    if args.simpletuner:
        from simpletuner_side import SimpleTunerSide

        from rayflux.testing.tiny import ensure_tiny_model

        st = SimpleTunerSide(args.simpletuner, work, images, ensure_tiny_model(), args.resolution, args.steps)
    if args.source:
        return report_from(args.source, codes, results, args, st)
    for r in range(args.rounds):
        print(f"round {r}: load average {os.getloadavg()}", flush=True)
        sides = [*codes, *([st] if st else []), *(["floor"] if args.floor else [])]
        for side in sides if r % 2 == 0 else sides[::-1]:
            if side is st:
                st.run_round(f"r{r}", args.cold_only)
            elif side == "floor":
                run_floor(work, r, args.cold_only, floor)
            else:
                run_round(side, codes.index(side), r, work, common, results[str(side)], args)
    report(codes, results, args)
    if st:
        from simpletuner_side import side_by_side

        side_by_side(results[str(ROOT)], st.runs, args.images)
    if args.floor:
        floor_report(results[str(ROOT)], floor, st.runs if st else None)
    print(f"load average at the end: {os.getloadavg()}")
    return 0


def run_round(code: Path, c: int, r: int, work: Path, common: list[str], res: dict, args) -> None:
    """One round of ``code``'s runs: cold (an empty cache), then warm and, with ``--slope``, short on its cache."""
    tag = f"r{r}-c{c}"
    cache = work / f"cache-{tag}"
    kinds = [("cold", args.steps)] + ([] if args.cold_only else [("warm", args.steps)])
    for kind, steps in kinds + ([("short", args.slope)] if args.slope else []):
        res[kind].append(
            run_job(code, work / f"{kind}-{tag}", [*common, f"cache.dir={cache}", f"train.max_steps={steps}"])
        )
    res["cold"][-1]["cache_bytes"] = tree_bytes(cache)
    saved = work / f"cold-{tag}.times.json"
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "cache_bytes": res["cold"][-1]["cache_bytes"]}))
    shutil.rmtree(cache, ignore_errors=True)
    line = ", ".join(f"{k} {res[k][-1]['exit'] - res[k][-1]['launch']:.1f}s" for k, _ in kinds)
    print(f"round {r} {code}: {line}", flush=True)


def run_floor(work: Path, r: int, cold_only: bool, floor: dict[str, list[dict]]) -> None:
    """One round of ``ray_floor.py``: with an actor pool (the cold floor) and, unless ``cold_only``, without."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error"}
    for kind in ["cold"] + ([] if cold_only else ["warm"]):
        argv = [sys.executable, str(ROOT / "benchmarks" / "ray_floor.py"), *(["--cold"] if kind == "cold" else [])]
        m = run_measured(argv, env, ROOT, work / f"floor-{kind}-r{r}.log", timeout=600)
        if m.returncode != 0:
            raise SystemExit(f"ray_floor.py failed: {m.tail}")
        phases = json.loads(m.tail.strip().splitlines()[-1])
        floor[kind].append({"launch": m.launch, "exit": m.exit, "cpu": m.cpu, "phases": phases})
        (work / f"floor-{kind}-r{r}.json").write_text(json.dumps(floor[kind][-1]))
    print(
        f"round {r} floor: " + ", ".join(f"{k} {v[-1]['exit'] - v[-1]['launch']:.1f}s" for k, v in floor.items() if v)
    )


def floor_report(
    ours: dict[str, list[dict]], floor: dict[str, list[dict]], theirs: dict[str, list[dict]] | None
) -> None:
    """The floor's wall and CPU beside the job's and SimpleTuner's, as medians of per-round ratios."""
    print("\n| run | measure | floor | floor's phases (median s) | job ÷ floor | floor ÷ SimpleTuner |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind, runs in floor.items():
        if not runs:
            continue
        names = list(runs[0]["phases"])
        phases = ", ".join(f"{n} {statistics.median(x['phases'][n] for x in runs):.1f}" for n in names)
        for label, get in (("end to end (s)", lambda x: x["exit"] - x["launch"]), ("CPU seconds", lambda x: x["cpu"])):
            job = [get(a) / get(b) for a, b in zip(ours[kind], runs)]
            st = [get(b) / get(c) for b, c in zip(runs, (theirs or {}).get(kind, []))]
            print(
                f"| {kind} | {label} | {statistics.median(get(x) for x in runs):.1f} | "
                f"{phases if label.startswith('end') else ''} | {_ratios(job)} | {_ratios(st)} |"
            )


def _ratios(values: list[float]) -> str:
    return f"**{statistics.median(values):.2f}** ({', '.join(f'{v:.2f}' for v in values)})" if values else "-"


def report_from(work: Path, codes: list[Path], results: dict, args, st=None) -> int:
    """Report on the finished runs under ``work`` (``<kind>-r<round>-c<code>``, code as ordered by ``--code``); a
    round is used only when all its runs finished. Runs without a saved launch time have no end-to-end rows."""
    rounds = sorted({int(p.name.split("-")[1][1:]) for p in work.glob("cold-r*-c*") if p.is_dir()})
    kinds = ["cold"] + ([] if args.cold_only else ["warm"]) + (["short"] if args.slope else [])
    for r in rounds:
        outs = {(k, c): work / f"{k}-r{r}-c{c}" for k in kinds for c in range(len(codes))}
        if not all((o / "ledger.json").exists() and (o / "metrics").exists() for o in outs.values()):
            continue
        try:
            runs = {key: read_run(o) for key, o in outs.items()}
        except (KeyError, TypeError, json.JSONDecodeError):
            continue  # a run cut off before its end
        for (k, c), run in runs.items():
            results[str(codes[c])][k].append(run)
    args.rounds = len(results[str(codes[0])]["cold"])
    report(codes, results, args)
    if st:
        from simpletuner_side import side_by_side

        st.load(work)
        side_by_side(results[str(ROOT)], st.runs, args.images)
    if args.floor:
        saved = {k: [work / f"floor-{k}-r{r}.json" for r in rounds] for k in ("cold", "warm")}
        floor = {k: [json.loads(p.read_text()) for p in paths if p.exists()] for k, paths in saved.items()}
        floor_report(results[str(ROOT)], floor, st.runs if st else None)
    return 0


SLOPE_PARTS = [
    ("train stage", "train_start", "train_end"),
    ("  stage start -> first step", "train_start", "step_end"),
    ("  first -> last step", "step_end", "last_step_end"),
    ("  last step -> stage end", "last_step_end", "train_end"),
]


def slope_report(long: list[dict], short: list[dict], extra: int, args) -> None:
    """What each extra step adds to the train stage and to its parts, against the step log's mean ``step_time``."""
    step = statistics.median(w["step_time"] for w in long)
    print(
        f"extra step ({args.slope} -> {args.steps} steps), ms per step (median of {len(long)}); step log's mean "
        f"step_time {step * 1000:.1f} ms"
    )
    if all("compute" in w for w in long):
        compute, between = (statistics.median(w[k] for w in long) for k in ("compute", "between"))
        print(
            f"  of which LoraTrainer.train_step {compute * 1000:.1f} ms, the loop's work between steps "
            f"{between * 1000:.1f} ms"
        )
    for label, a, b in SLOPE_PARTS:
        if all(a in r and b in r for r in long + short):
            added = [((w[b] - w[a]) - (s[b] - s[a])) / extra for w, s in zip(long, short)]
            med = statistics.median(added)
            print(
                f"{label}: {med * 1000:.1f} ms (rounds: {', '.join(f'{x * 1000:.0f}' for x in added)})"
                + (f"; step_time ÷ added wall {step / med:.2f}" if label == "train stage" else "")
            )


def report(codes: list[Path], results: dict, args) -> None:
    print(
        f"\n{args.images} images, {args.resolution} px, {args.steps} steps, 1 worker; medians of {args.rounds} "
        "rounds (seconds)"
    )
    for code in codes:
        res = results[str(code)]
        print(f"\n{code}\n| phase | cold: start | end | s | warm: start | end | s |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for (label, *cold), (_, *warm) in zip(phase_rows(res["cold"]), phase_rows(res["warm"])):
            print(f"| {label} | {' | '.join(_fmt(v) for v in [*cold, *warm])} |")
        if res["short"]:
            slope_report(res["warm"], res["short"], args.steps - args.slope, args)
    base = results[str(codes[0])]
    for kind in ("cold", "warm"):
        for label, a, b in (("end to end", "launch", "exit"), ("Ray start -> export end", "ray_start", "export_end")):
            for code in codes[1:]:
                pairs = [
                    (x, y)
                    for x, y in zip(base[kind], results[str(code)][kind])
                    if all(k in r for r in (x, y) for k in (a, b))
                ]
                ratios = [(x[b] - x[a]) / (y[b] - y[a]) for x, y in pairs]
                if ratios:
                    print(
                        f"{kind}: this tree ÷ {code}, {label}: median {statistics.median(ratios):.3f} "
                        f"(rounds: {', '.join(f'{v:.3f}' for v in ratios)})"
                    )


if __name__ == "__main__":
    sys.exit(main())
