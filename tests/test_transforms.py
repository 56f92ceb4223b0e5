"""Byte planes: the CPU's plane-at-a-time copy is the same permutation as the transposed view."""

import pytest
import torch

from nvcomp_ckpt_engine import transforms


@pytest.mark.parametrize("width", [2, 4, 8, 16])
def test_byte_planes_on_the_cpu_are_the_transposed_bytes_and_invert_bit_exactly(width):
    data = torch.randint(0, 256, (width * 1001,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(width))
    planes = transforms.to_planes(data, width)
    assert torch.equal(planes, data.view(-1, width).t().contiguous().view(-1))
    out = torch.empty_like(data)
    transforms.from_planes(planes, width, out)
    assert torch.equal(out, data)


def test_byte_planes_write_into_a_view_of_a_larger_buffer():
    buffer = torch.zeros(64, dtype=torch.uint8)
    data = torch.arange(32, dtype=torch.uint8)
    transforms.from_planes(transforms.to_planes(data, 4), 4, buffer[16:48])
    assert torch.equal(buffer[16:48], data)
    assert not buffer[:16].any() and not buffer[48:].any()
