import json
import sys
import time

sys.path.insert(0, ".")
sys.argv = ["x"]
import guard_holdout  # noqa: E402 (after the sys.path entry above)

started = time.monotonic()
scen = [s for s in guard_holdout.grid() if s[3][0] in ("mindspore-2.7.1", "mindspore-2.7.1-novmm")]
fig = guard_holdout.measure(scen, 2)
print(guard_holdout.report(fig, "held-out grid, MindSpore 2.7.1 rows (VMM on and off)"))
for line in fig["missed"]:
    print("  missed:", line)
for line in fig["false_critical"]:
    print("  false critical:", line)
print(f"({time.monotonic() - started:.0f}s)")
json.dump(fig, open("/tmp/holdout_sub.json", "w"), indent=1, default=str)
