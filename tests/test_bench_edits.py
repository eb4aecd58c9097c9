"""The edits benchmarks' CPU smoke runs: bench_edits_speed (served edits against text-to-image over HTTP) and
bench_edits_quality (shapes-flux's edits scored), each writing its JSON with the figures the issue reads."""
import json
import os
import subprocess
import sys

import pytest

from tests.bench_smoke import BENCHMARKS, run_smoke


@pytest.mark.slow
def test_bench_edits_speed_times_edits_against_text_requests_of_one_key(tmp_path):
    result, proc = run_smoke("bench_edits_speed.py", tmp_path / "speed.json", "--steps", "4", "--rounds", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(result["ms"]) == {"text", "img2img", "inpaint"} and len(result["ms"]["text"]["rounds"]) == 3
    assert result["img2img_over_text"]["median"] > 0 and result["inpaint_over_text"]["median"] > 0
    # strength 0.6 of 4 steps: diffusers' get_timesteps starts at int(4 - 2.4) = 1, so 3 steps run
    assert result["steps_computed"] == {"text": [4], "img2img": [3], "inpaint": [3]}
    assert result["source"]["commit"] and result["all_warm"] is False   # CPU replicas: every call eager


def test_bench_edits_quality_scores_each_variant_against_the_new_and_the_old_caption(tmp_path):
    out = tmp_path / "quality.json"
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "bench_edits_quality.py"), "--scenes", "2",
                           "--steps", "2", "--threads", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"text", "inpaint", "img2img_0.3", "img2img_0.9"}
    for entry in result["variants"].values():
        assert 0 <= entry["new_caption"]["colour_shape"] <= 1 and entry["psnr_db"]["median"] > 0
    assert result["variants"]["inpaint"]["psnr_outside_mask_db"]["median"] > result["variants"]["inpaint"]["psnr_db"]["median"]
    assert result["new_captions"] != result["captions"] and len(result["scene_seeds"]) == 2


@pytest.mark.slow
def test_bench_edits_speed_times_kontext_edits_against_text_requests(tmp_path):
    result, proc = run_smoke("bench_edits_speed.py", tmp_path / "kontext.json", "--kontext", "--steps", "2",
                             "--rounds", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["model"] == "tiny-flux-kontext" and set(result["ms"]) == {"text", "kontext"}
    assert result["app_args"]["warmup"] == "64x64,64x64.r4x4" and result["kontext_over_text"]["median"] > 0
    assert result["steps_computed"] == {"text": [2], "kontext": [2]}


@pytest.mark.slow
def test_bench_edits_speed_times_image_to_video_against_text_to_video(tmp_path):
    result, proc = run_smoke("bench_edits_speed.py", tmp_path / "video.json", "--video", "--steps", "2",
                             "--rounds", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["model"] == "tiny-wan22-ti2v-5b" and set(result["ms"]) == {"text", "i2v"}
    assert result["app_args"]["warmup"] == "64x64.f5.cfg" and result["frames"] == 5
    assert result["i2v_over_text"]["median"] > 0 and len(result["ms"]["i2v"]["rounds"]) == 3
    assert result["steps_computed"] == {"text": [2], "i2v": [2]}
