"""Where the CUDA build's CLI steps die (bench/gpu/README.md §5): ``python bench/gpu/diag.py``.

The first device run saw every ``ngramspec calibrate`` / ``bench e2e`` / ``serve`` die with
SIGSEGV and no output, while the driver step (the same ``load_model`` and decodes, imported
after ``import llama_cpp``) worked. Each case below is one subprocess on one random-shape
Llama-3.2-1B Q4_0 (written here in about a second), llama.cpp's log visible, faulthandler to a
file of its own, ``STAGE`` lines flushed before each step, so the reply says which import or
call a crash follows. The cause found (CASES' comment): the order in which libstdc++ and
llama.cpp's CUDA libraries load; the cases keep checking the fix (`ngramspec.load_order`).

Writes ``$OUT/diag.txt`` (each case: rc, its STAGE lines, faulthandler's frames, the last lines
of llama.cpp's log). Run by run_device.sh's build phase before the curves, about a minute.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

from measure import _text   # this folder is the script's: the kit's one bytes-or-str reader

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
STATE = pathlib.Path(os.environ.get("GPU_KIT_STATE", "/tmp/ngramspec-gpukit"))
OUT = pathlib.Path(os.environ.get("OUT") or HERE / "kit" / "dry-out")
CPU = os.environ.get("GPU_KIT_CPU") == "1"

#: the part every case shares: load through ngramspec, one decode, a two-point calibration
CORE = """
def stage(s):
    print("STAGE", s, flush=True)
stage("load")
from ngramspec.llama.model import load_model
llm = load_model(MODEL, n_ctx=4096, n_threads=4, verbose=True)
stage("decode")
from ngramspec.llama.decoder import target_decoder, reset_context
dec = target_decoder(llm)
import numpy as np
lo = min(1000, dec.n_vocab // 2)
rows = dec.decode(np.arange(lo, lo + 40, dtype=np.int32), 0, all_logits=True)
stage(f"decoded {rows.shape}")
reset_context(llm, dec)
stage("calibrate")
from ngramspec.llama import calibration
cm = calibration.calibrate(llm, ks=(1, 4, 64), reps=1)
stage(f"calibrated {cm.ks} {cm.n_pasts}")
"""

#: (name, code before CORE, extra environment). What the device said on 2026-11-28 (three
#: calls, README §5): every load through ngramspec died inside llama_model_load, with or without
#: GPU layers and with extra buffer types on or off, and llama-cpp-python's own load worked when
#: `import llama_cpp` came first; a bisection of the first import found numpy, any of
#: ngramspec's kernels and ``ctypes.CDLL("libstdc++.so.6")`` alone each enough to make the next
#: CUDA load die. ngramspec.load_order now imports a GPU build first; these cases check it.
#: llama-cpp-python's own Llama, repacking off (as ngramspec loads on AMX hosts, whose repacked
#: kernel crashes on its own: ngramspec.llama.repack) so that the cases differ in order alone
OWN = ("def own():\n"
       "    import llama_cpp\n"
       "    from ngramspec.llama.repack import extra_buffer_types\n"
       "    with extra_buffer_types(False):\n"
       "        return llama_cpp.Llama(MODEL, n_ctx=4096, n_batch=512, n_ubatch=512, "
       "n_threads=4, n_gpu_layers=-1, flash_attn=False, verbose=True)\n")
CASES = [
    ("core (ngramspec's load; import ngramspec first)", "", {}),
    ("numpy imported first, then llama-cpp-python's own Llama",
     OWN + "stage('numpy')\nimport numpy\nstage('own load')\nx = own()\nstage('own eval')\n"
     "x.eval(list(range(200, 240)))\nstage('own ok')\ndel x\n", {}),
    ("llama-cpp-python's own Llama first, then core",
     OWN + "stage('own load')\nx = own()\nstage('own eval')\nx.eval(list(range(200, 240)))\n"
     "stage('own ok')\ndel x\n", {}),
]


def _write_model() -> pathlib.Path:
    path = STATE / "models" / "diag-1b-q4_0.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        name = "tiny" if CPU else "llama-3.2-1b"
        subprocess.run([sys.executable, str(HERE / "shapes.py"), name, "q4_0", str(path)],
                       check=True, capture_output=True)
    return path


def _case(i: int, name: str, pre: str, env: dict, model: pathlib.Path, out) -> None:
    faults = STATE / "faults" / f"diag-{i}.txt"
    faults.parent.mkdir(parents=True, exist_ok=True)
    faults.unlink(missing_ok=True)
    code = (f"import faulthandler\nfaulthandler.enable(file=open({str(faults)!r}, 'w'), "
            f"all_threads=True)\nMODEL = {str(model)!r}\n"
            "def stage(s):\n    print('STAGE', s, flush=True)\n" + pre + CORE)
    t = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, timeout=30, env={**os.environ, **env})
        rc, so, se = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, so, se = "timeout", _text(e.stdout), _text(e.stderr)
    out.write(f"== {i} {name}: rc {rc}, {time.time() - t:.1f} s\n")
    out.write("".join(line + "\n" for line in so.splitlines() if line.startswith("STAGE")))
    if rc != 0:
        if faults.exists():
            out.write("-- faulthandler:\n" + faults.read_text()[-2500:])
        out.write("-- log tail:\n" + "\n".join(se.splitlines()[-25:]) + "\n")
    out.flush()


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    model = _write_model()
    with open(OUT / "diag.txt", "w") as out:
        for i, (name, pre, env) in enumerate(CASES):
            _case(i, name, pre, env, model, out)
    sys.stdout.write((OUT / "diag.txt").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
