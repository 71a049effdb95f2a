"""Write a copy of asv_benchmarks/asv.conf.json whose results, html and environments
go to a temporary folder, with the repository and benchmark paths made absolute, so
that asv runs from anywhere without writing into the checkout.

    python tools/asv_temp_config.py TMP_DIR      (writes TMP_DIR/asv.conf.json)

Used by tools/check_docs_and_bench.sh and tools/gpu_check.sh.
"""

import json
import os
import sys

from asv import util


def main(tmp: str) -> str:
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "asv_benchmarks", "asv.conf.json")
    conf = util.load_json(src, js_comments=True)
    here = os.path.dirname(os.path.abspath(src))
    conf["repo"] = os.path.normpath(os.path.join(here, conf["repo"]))
    conf["benchmark_dir"] = os.path.normpath(os.path.join(here, conf["benchmark_dir"]))
    for key in ("results_dir", "html_dir", "env_dir"):
        conf[key] = os.path.join(tmp, key)
    dst = os.path.join(tmp, "asv.conf.json")
    with open(dst, "w") as f:
        json.dump(conf, f, indent=1)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
