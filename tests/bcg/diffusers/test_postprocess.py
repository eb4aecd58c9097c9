"""`bcg.diffusers.step_batching.steps.postprocess_async`: the step batcher's decode output is the pipeline's, pixel for pixel."""
import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor

from bcg.diffusers.step_batching.steps import postprocess_async


def postprocess(processor, image, output_type):
    return postprocess_async(processor, image, output_type)()


def _decoded(dtype, channels=3):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, channels, 16, 24, generator=g) * 2.4 - 1.2  # beyond [-1, 1] too: the clamp
    # values whose x * 255 lies at or next to .5 after denormalizing: the rounding of halves must agree
    half = (torch.arange(16, dtype=torch.float64) + 0.5) / 255 * 2 - 1
    x[0, 0, 0, :16] = half.to(torch.float32)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [3, 1])
def test_pil_images_are_the_processors_pixel_for_pixel(dtype, channels):
    processor = VaeImageProcessor(vae_scale_factor=8)
    image = _decoded(dtype, channels)
    want = processor.postprocess(image.clone(), output_type="pil")
    got = postprocess(processor, image.clone(), "pil")
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        assert a.mode == b.mode and a.size == b.size
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_other_outputs_and_processors_take_the_processors_own_path():
    class Custom(VaeImageProcessor):
        @staticmethod
        def numpy_to_pil(images):
            return ["custom"] * len(images)

    image = _decoded(torch.float32)
    assert postprocess(Custom(vae_scale_factor=8), image, "pil") == ["custom"] * 3
    no_norm = VaeImageProcessor(vae_scale_factor=8, do_normalize=False)
    assert [np.asarray(a).tolist() for a in postprocess(no_norm, image.clamp(0, 1), "pil")] == \
        [np.asarray(b).tolist() for b in no_norm.postprocess(image.clamp(0, 1), output_type="pil")]
    np_out = postprocess(VaeImageProcessor(vae_scale_factor=8), image, "np")
    assert len(np_out) == 3 and np_out[0].shape == (16, 24, 3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", ["tiny-wan", "tiny-pixart"])
def test_a_request_run_alone_makes_the_pipelines_pil_images_from_8_bits_on_the_device(name, device, monkeypatch):
    """Pipelines without step hooks run alone; their PIL output is converted to 8 bits on the device (as the
    step families' decode is), not in NumPy on the host thread that runs the pipeline: 40 M values of a
    33-frame 832x480 video scaled, rounded and cast there on every request, then answered from that thread."""
    from bcg.diffusers.step_batching.batcher import StepBatcher
    from bcg.diffusers.models import load_pipeline
    from bcg.diffusers.pipelines import plan_request

    pipe = load_pipeline(name).to(device)  # on CUDA the 8 bits come back through pinned memory
    video = name == "tiny-wan"
    shape = dict(size="64x48", num_frames=5) if video else dict(size="64x64")
    _, kwargs = plan_request(pipe, "a red fox in the snow", steps=2, seed=3, **shape)
    assert kwargs["output_type"] == "pil"
    want = pipe(**{**kwargs, "generator": torch.Generator().manual_seed(3)})
    want = want.frames if video else [want.images]

    processor = pipe.video_processor if video else pipe.image_processor
    host_conversions = []
    own = processor.numpy_to_pil
    monkeypatch.setattr(processor, "numpy_to_pil", lambda images: host_conversions.append(1) or own(images),
                        raising=False)
    batcher = StepBatcher(pipe)
    assert batcher.family is None  # every request of this pipeline runs alone
    future = batcher.submit_planned(plan_request(pipe, "a red fox in the snow", steps=2, seed=3, **shape)[0],
                                    {**kwargs, "generator": torch.Generator().manual_seed(3)})
    assert batcher.step() and future.done()
    got = future.result(timeout=0)
    got = got if video else [got]
    assert host_conversions == []
    assert batcher.stats()["ran_alone"] == 1 and batcher.stats()["leaves"] == 1
    assert [len(v) for v in got] == [len(v) for v in want]
    for frames, expected in zip(got, want):
        for a, b in zip(frames, expected):
            assert a.mode == b.mode and a.size == b.size
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
