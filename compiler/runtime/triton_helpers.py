"""``@triton.jit`` helpers that generated kernels call: NaN-propagating min/max,
arg-reductions with first-index tie breaking, and Welford's combine."""

import triton
import triton.language as tl


@triton.jit
def maximum(a, b):
    # NaN wins, as in eager's max.
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def minimum(a, b):
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def max2(a, dim: tl.constexpr):
    return tl.reduce(a, dim, maximum)


@triton.jit
def min2(a, dim: tl.constexpr):
    return tl.reduce(a, dim, minimum)


@triton.jit
def _prod(a, b):
    return a * b


@triton.jit
def prod(a, dim: tl.constexpr):
    return tl.reduce(a, dim, _prod)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def xor_sum(a, dim: tl.constexpr):
    return tl.reduce(a, dim, _xor)


@triton.jit
def _argmax_combine(a_value, a_index, b_value, b_index):
    a_nan = a_value != a_value
    b_nan = b_value != b_value
    greater = (a_value > b_value) | (a_nan & ~b_nan)
    equal = (a_value == b_value) | (a_nan & b_nan)
    take_a = greater | (equal & (a_index < b_index))
    return tl.where(take_a, a_value, b_value), tl.where(take_a, a_index, b_index)


@triton.jit
def _argmin_combine(a_value, a_index, b_value, b_index):
    a_nan = a_value != a_value
    b_nan = b_value != b_value
    less = (a_value < b_value) | (a_nan & ~b_nan)
    equal = (a_value == b_value) | (a_nan & b_nan)
    take_a = less | (equal & (a_index < b_index))
    return tl.where(take_a, a_value, b_value), tl.where(take_a, a_index, b_index)


@triton.jit
def max_with_index(value, index, dim: tl.constexpr):
    return tl.reduce((value, index), dim, _argmax_combine)


@triton.jit
def min_with_index(value, index, dim: tl.constexpr):
    return tl.reduce((value, index), dim, _argmin_combine)


@triton.jit
def argmax_step(acc_value, acc_index, value, index):
    return _argmax_combine(acc_value, acc_index, value, index)


@triton.jit
def argmin_step(acc_value, acc_index, value, index):
    return _argmin_combine(acc_value, acc_index, value, index)


@triton.jit
def welford_step(value, mean, m2, weight, first):
    # One new value per lane; the first iteration starts each lane's accumulator.
    new_weight = tl.where(first, 1.0, weight + 1.0)
    delta = value - mean
    new_mean = tl.where(first, value, mean + delta / new_weight)
    new_m2 = tl.where(first, 0.0, m2 + delta * (value - new_mean))
    return new_mean, new_m2, new_weight


@triton.jit
def welford_combine(mean_1, m2_1, weight_1, mean_2, m2_2, weight_2):
    delta = mean_2 - mean_1
    new_weight = weight_1 + weight_2
    w2_over_w = tl.where(new_weight == 0.0, 0.0, weight_2 / new_weight)
    return (
        mean_1 + delta * w2_over_w,
        m2_1 + m2_2 + delta * delta * weight_1 * w2_over_w,
        new_weight,
    )


@triton.jit
def welford(mean, m2, weight, dim: tl.constexpr):
    return tl.reduce((mean, m2, weight), dim, welford_combine)
