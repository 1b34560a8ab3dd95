"""benchmarks/attention_layout.py and sustained_clock.py on a CPU: inputs, readings, arguments (timing needs a GPU)."""

import json

import pytest
import torch

from benchmarks import attention_layout as al


def test_the_layouts_have_the_strides_the_model_hands_sdpa():
    B, H, T, D = 2, 3, 8, 4
    C = H * D
    shape = (B, H, T, D)
    q, k, v, do = al.make_inputs("bhtd", B, H, T, D, seed=0, device="cpu")
    assert all(t.shape == shape and t.is_contiguous() for t in (q, k, v, do))
    q, k, v, do = al.make_inputs("qkv_split", B, H, T, D, seed=0, device="cpu")
    # as in shared/model/gpt.py: views of one (B, T, 3C) tensor, transposed to (B, H, T, D)
    assert all(t.shape == shape and t.stride() == (T * 3 * C, D, 3 * C, 1) for t in (q, k, v))
    assert q._base is k._base is v._base and q._base.shape == (B, T, 3 * C) and q._base.requires_grad
    assert do.shape == shape and do.stride() == (T * C, D, C, 1)
    q, k, v, do = al.make_inputs("bthd", B, H, T, D, seed=0, device="cpu")
    assert all(t.shape == shape and t.stride() == (T * C, D, C, 1) and t.requires_grad for t in (q, k, v))
    assert q._base is not k._base


def test_each_call_takes_the_next_input_set_and_returns_the_gradients():
    sets = [al.make_inputs("qkv_split", 1, 2, 4, 2, seed=s, device="cpu") for s in range(2)]
    seen = []
    fwd, fwd_bwd = al.calls(lambda q, k, v: seen.append(q) or (q * k * v), sets)
    fwd()
    grads = fwd_bwd()
    assert seen[0] is sets[0][0] and seen[1] is sets[1][0]
    assert [g.shape for g in grads] == [sets[1][0].shape] * 3


def test_bad_arguments_are_refused():
    for argv in (["--dropouts", "1.0"], ["--rounds", "0"], ["--backends", "xformers"], ["--seq", "0"]):
        with pytest.raises(SystemExit):
            al.parse_args(argv)
    with pytest.raises(ValueError, match="unknown layout"):
        al.make_inputs("bshd", 1, 1, 1, 1, seed=0, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        al.main(al.parse_args([]))


def test_sustained_clock_takes_each_windows_telemetry_readings_and_refuses_bad_arguments(tmp_path):
    import datetime as dt

    from benchmarks import sustained_clock as sc
    from harness import telemetry

    stamp = lambda t: dt.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    t = 1_800_000_000.0
    csv = tmp_path / "s.gpu.csv"
    csv.write_text("# timestamp,index,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active\n"
                   f"{stamp(t + 0.5)}, 0, 1980, 300.00, 40, 0x0000000000000000\n"
                   f"{stamp(t + 1.5)}, 0, 1700, 690.00, 60, 0x0000000000000004\n"
                   f"{stamp(t + 1.7)}, 0, 1600, 700.00, 62, 0x0000000000000004\n"
                   f"{stamp(t + 1.8)}, 0, [N/A], [N/A], 63, 0x0000000000000004\n")
    readings = telemetry.parse(csv)[0]
    assert sc.window_reading(readings, t + 1.0, t + 2.0) == {
        "readings": 3, "sm_mhz": 1650.0, "power_w": 695.0, "temp_c": 63.0, "event_reasons": ["0x0000000000000004"]}
    assert sc.window_reading(readings, t + 3.0, t + 4.0) == {
        "readings": 0, "error": "none of the 4 readings lies in the timed window"}
    assert sc.window_reading([], t, t + 1) == {"readings": 0,
                                               "error": "none of the 0 readings lies in the timed window"}
    for argv in (["--dropout", "-0.1"], ["--seconds", "0"], ["--window", "0"], ["--batch", "0"]):
        with pytest.raises(SystemExit):
            sc.parse_args(argv)


def test_a_benchmark_result_is_written_where_asked_with_its_folder(tmp_path, capsys):
    from shared.train.results import write_json

    out = tmp_path / "new" / "folder" / "r.json"
    write_json(out, {"command": "python x.py", "path": tmp_path}, default=str)
    assert json.loads(out.read_text()) == {"command": "python x.py", "path": str(tmp_path)}
    assert f"wrote {out}" in capsys.readouterr().out
