"""The strategy registry (minifsdp/strategies.py): each strategy declares the flags it takes,
and ``train.parse_args`` refuses the strict ones everywhere else, naming who takes them."""

import pytest

from minifsdp.strategies import STRATEGIES, STRICT, takers
from minifsdp.train import parse_args

# a value each strict flag can be set to, other than its default
SET = {"param_dtype": "bf16", "reduce_dtype": "bf16", "output_dtype": "bf16",
       "buffer_dtype": "bf16", "clip_grad_norm": "1", "forward_prefetch": "explicit",
       "backward_prefetch": "explicit", "hsdp": "2", "comm_buffers": "process-group"}


def test_every_strict_flag_has_a_value_here():
    assert SET.keys() == STRICT.keys()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_strict_flag_is_refused_where_it_does_not_apply(name, capsys):
    for dest, value in SET.items():
        argv = ["--strategy", name, "--" + dest.replace("_", "-"), value]
        if dest in STRATEGIES[name].takes:
            continue
        with pytest.raises(SystemExit):
            parse_args(argv)
        err = capsys.readouterr().err
        assert f"applies to --strategy {takers(dest)[0]}" in err and "only" in err, argv


def test_a_value_the_strategy_does_not_take_is_refused_with_its_reason(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--strategy", "fsdp2", "--backward-prefetch", "backward_pre"])
    assert "applies to --strategy fsdp1 and torch_fsdp1 only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--strategy", "torch_fsdp1", "--backward-prefetch", "explicit"])
    assert "FSDP1 takes backward_pre, backward_post or none" in capsys.readouterr().err


def test_defaults_fill_what_was_left_unset():
    assert parse_args(["--strategy", "fsdp2"]).backward_prefetch == "implicit"
    assert parse_args(["--strategy", "fsdp1"]).backward_prefetch is None  # each library's own
    # FSDP1's wrapping flags are listed, not strict: one argument list serves a comparison
    assert parse_args(["--strategy", "single", "--auto-wrap", "transformer"]).auto_wrap == \
        "transformer"


def test_help_lists_who_takes_each_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "[--strategy fsdp2, torch_fsdp2]" in out  # --hsdp
    assert "[--strategy torch_ddp, bucketed_ddp, zero1, zero2]" in out  # --bucket-cap-mb
