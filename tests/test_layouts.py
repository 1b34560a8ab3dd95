import pytest
import torch

from shared.model import layouts
from shared.model.config import preset


def test_causal_is_lower_triangle():
    lay = layouts.causal(4)
    assert lay.shape == (1, 4, 4) and torch.equal(lay[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert layouts.is_causal(lay)
    assert layouts.density(lay) == pytest.approx(10 / 16)


def test_local_window():
    lay = layouts.local(5, 2)[0]
    for i in range(5):
        assert lay[i].nonzero().flatten().tolist() == [j for j in (i - 1, i) if j >= 0]


def test_strided_fixed_pattern():
    lay = layouts.strided(8, 4)[0]
    # block 6 (segment 1) sees its own segment's blocks 4, 5, 6 and the summary block 3 of segment 0
    assert lay[6].nonzero().flatten().tolist() == [3, 4, 5, 6]
    assert lay[2].nonzero().flatten().tolist() == [0, 1, 2]


def test_token_mask_is_causal_inside_diagonal_blocks():
    mask = layouts.token_mask(layouts.local(4, 1), block=2)[0]  # only diagonal blocks
    assert mask.shape == (8, 8)
    assert mask[1, 0] and mask[1, 1] and not mask[0, 1] and not mask[2, 1]


def test_user_layout_validation_errors():
    with pytest.raises(ValueError, match="does not fit"):
        layouts.validate(torch.ones(3, 4, 4, dtype=torch.bool).tril(), n_head=2, n_blocks=4)
    with pytest.raises(ValueError, match="above the diagonal"):
        layouts.validate(torch.ones(1, 4, 4, dtype=torch.bool), n_head=2, n_blocks=4)
    empty_row = torch.ones(1, 4, 4, dtype=torch.bool).tril()
    empty_row[0, 2] = False
    with pytest.raises(ValueError, match="row is empty .*query block 2"):
        layouts.validate(empty_row, n_head=2, n_blocks=4)
    with pytest.raises(ValueError, match="bool or 0/1"):
        layouts.validate(torch.full((1, 4, 4), 0.5).tril(), n_head=2, n_blocks=4)


def test_user_layout_from_file_per_head(tmp_path):
    lay = torch.stack([layouts.causal(8)[0], layouts.local(8, 2)[0]]).int()
    path = tmp_path / "layout.pt"
    torch.save(lay, path)
    cfg = preset("tiny", n_head=2, layout=str(path))
    got = layouts.make_layout(cfg)
    assert got.dtype == torch.bool and torch.equal(got, lay.bool())
    with pytest.raises(ValueError, match="does not exist"):
        layouts.make_layout(preset("tiny", layout=str(tmp_path / "missing.pt")))


def test_unreadable_or_invalid_layout_files_are_refused_naming_the_file(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"garbage\.pt' is not a tensor saved with torch.save.*\(2 or 1, 8, 8\)"):
        layouts.make_layout(preset("tiny", n_head=2, layout=str(garbage)))
    above = tmp_path / "above.pt"
    torch.save(torch.ones(1, 8, 8, dtype=torch.bool), above)
    with pytest.raises(ValueError, match=r"layout file '.*above\.pt': layout has a block above the diagonal"):
        layouts.make_layout(preset("tiny", n_head=2, layout=str(above)))
