"""The host launch arithmetic agrees with Triton's own."""

import triton

from metrale.kernels.grid import cdiv, next_power_of_2


def test_matches_triton() -> None:
    for n in [1, 2, 3, 4, 5, 15, 16, 17, 100, 1023, 1024, 1025, 128256]:
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 128):
            assert cdiv(n, d) == triton.cdiv(n, d)
