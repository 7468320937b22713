"""A measured curve of a GPU kit result as the source of cost.py's ``gpu`` profile (issue 30,
item 3): ``python bench gpu-profile bench/results/gpu.json [--curve KEY]`` prints the function
that replaces ``_gpu_profile`` in ngramspec/cost.py, with the device, build and date beside the
numbers. A CPU dry run's result is refused: its curve is no GPU's."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

DEFAULT_CURVE = "llama-3.1-8b-q4_0"


def profile_source(res: dict, key: str = DEFAULT_CURVE) -> str:
    """Python source of ``_gpu_profile()`` from ``res["curves"][key]``."""
    if res.get("dry_run"):
        raise ValueError("this gpu.json is a CPU dry run: its curves are not a GPU's")
    curves = res.get("curves", {})
    if key not in curves:
        raise ValueError(f"--curve: no curve {key!r} in this result; it has: "
                         f"{', '.join(curves) or 'none'}")
    curve, dev = curves[key], res.get("device", {})
    meta = curve.get("meta", {})
    ms_rows = [[round(s * 1e3, 4) for s in row] for row in curve["seconds"]]
    model = f"{meta.get('shape', key)} {meta.get('type', '')}".strip()
    where = (f"{dev.get('gpu', 'GPU')}, llama-cpp-python {dev.get('llama_cpp_python')} "
             f"CUDA build, {dev.get('date')}")
    return "\n".join([
        "def _gpu_profile() -> CostModel:",
        f"    # bench/results/gpu.md (issue 30's device kit, bench/gpu/): ngramspec calibrate on",
        f"    # {model} with random weights (bench/gpu/shapes.py), every layer offloaded;",
        f"    # {where};",
        f"    # ngramspec revision {dev.get('revision')}.",
        f"    source = ({json.dumps('bench/results/gpu.md: ' + model + ', ')}",
        f"              {json.dumps(where)})",
        f"    ks = {list(curve['ks'])}",
        f"    n_pasts = {list(curve['n_past'])}",
        "    ms = [  # ms per decode of k tokens, one row per KV length",
        *(f"        {row}," for row in ms_rows),
        "    ]",
        "    return _from_ms(ks, ms, n_pasts, \"gpu\", source,",
        f"                    model={json.dumps(model)}, backend=\"CUDA\")",
        ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench gpu-profile", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("result", help="a device run's gpu.json")
    ap.add_argument("--curve", default=DEFAULT_CURVE,
                    help="which measured curve (default %(default)s)")
    args = ap.parse_args(argv)
    res = json.loads(pathlib.Path(args.result).read_text())
    try:
        print(profile_source(res, args.curve))
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
