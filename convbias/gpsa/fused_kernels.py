"""The fused GPSA kernels' Triton source (`convbias.gpsa.fused` documents the math and runs them).

Plain functions, decorated with `triton.jit` on first use by `convbias.gpsa.fused._kernels`: Triton
reads TRITON_INTERPRET when it decorates, and its interpreter patches `tl` in this module's globals.
"""

import triton.language as tl


def forward_kernel(
    q_ptr, k_ptr, v_ptr, rows_ptr, cols_ptr, gate_ptr, out_ptr, content_ptr, lse_ptr,
    H, NQ, NK, D, DV, V_HEADS, QX, KX, QY, KY, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + bh * NQ * D + offs_m[:, None] * D + offs_d[None, :],
        mask=(offs_m[:, None] < NQ) & (offs_d[None, :] < D),
        other=0.0,
    )
    k_base = k_ptr + bh * NK * D
    v_base = v_ptr + (b * V_HEADS + h % V_HEADS) * NK * DV
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_c = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_p = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start_n in range(0, NK, BLOCK_N):
        offs_n = start_n + offs_n0
        k = tl.load(
            k_base + offs_n[:, None] * D + offs_d[None, :],
            mask=(offs_n[:, None] < NK) & (offs_d[None, :] < D),
            other=0.0,
        )
        v = tl.load(
            v_base + offs_n[:, None] * DV + offs_e[None, :],
            mask=(offs_n[:, None] < NK) & (offs_e[None, :] < DV),
            other=0.0,
        )
        s = tl.dot(q.to(DOT_DTYPE), tl.trans(k).to(DOT_DTYPE), input_precision=PRECISION) * scale
        s = tl.where(offs_n[None, :] < NK, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc_c = acc_c * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        # P[i, j] = rows[h, i // Qx, j // Kx] * cols[h, i % Qx, j % Kx], zero outside the grid
        tile = (offs_m[:, None] < NQ) & (offs_n[None, :] < NK)
        pos_rows = tl.load(
            rows_ptr + h * QY * KY + (offs_m[:, None] // QX) * KY + offs_n[None, :] // KX, mask=tile, other=0.0
        )
        pos_cols = tl.load(
            cols_ptr + h * QX * KX + (offs_m[:, None] % QX) * KX + offs_n[None, :] % KX, mask=tile, other=0.0
        )
        pos = pos_rows.to(tl.float32) * pos_cols.to(tl.float32)
        acc_p += tl.dot(pos.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
        m_i = m_new
    gate = tl.load(gate_ptr + h).to(tl.float32)
    content = acc_c / l_i[:, None]
    out = (1.0 - gate) * content + gate * acc_p
    store_mask = (offs_m[:, None] < NQ) & (offs_e[None, :] < DV)
    offs_out = bh * NQ * DV + offs_m[:, None] * DV + offs_e[None, :]
    tl.store(out_ptr + offs_out, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    tl.store(content_ptr + offs_out, content.to(content_ptr.dtype.element_ty), mask=store_mask)
    tl.store(lse_ptr + bh * NQ + offs_m, m_i + tl.log(l_i), mask=offs_m < NQ)


def key_grad_kernel(
    q_ptr, k_ptr, v_ptr, gate_ptr, grad_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    H, NQ, NK, D, DV, V_HEADS, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    key_mask = (offs_n[:, None] < NK) & (offs_d[None, :] < D)
    value_mask = (offs_n[:, None] < NK) & (offs_e[None, :] < DV)
    k = tl.load(k_ptr + bh * NK * D + offs_n[:, None] * D + offs_d[None, :], mask=key_mask, other=0.0)
    v = tl.load(
        v_ptr + (b * V_HEADS + h % V_HEADS) * NK * DV + offs_n[:, None] * DV + offs_e[None, :],
        mask=value_mask,
        other=0.0,
    )
    content_weight = 1.0 - tl.load(gate_ptr + h).to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for start_m in range(0, NQ, BLOCK_M):
        offs_m = start_m + offs_m0
        row_valid = offs_m < NQ
        q = tl.load(
            q_ptr + bh * NQ * D + offs_m[:, None] * D + offs_d[None, :],
            mask=row_valid[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        grad = tl.load(
            grad_ptr + bh * NQ * DV + offs_m[:, None] * DV + offs_e[None, :],
            mask=row_valid[:, None] & (offs_e[None, :] < DV),
            other=0.0,
        )
        lse = tl.load(lse_ptr + bh * NQ + offs_m, mask=row_valid, other=0.0)
        delta = tl.load(delta_ptr + bh * NQ + offs_m, mask=row_valid, other=0.0)
        s = tl.dot(q.to(DOT_DTYPE), tl.trans(k).to(DOT_DTYPE), input_precision=PRECISION) * scale
        c = tl.exp(s - lse[:, None])
        c = tl.where(row_valid[:, None] & (offs_n[None, :] < NK), c, 0.0)
        dv += content_weight * tl.dot(
            tl.trans(c.to(grad.dtype)).to(DOT_DTYPE), grad.to(DOT_DTYPE), input_precision=PRECISION
        )
        dp = tl.dot(grad.to(DOT_DTYPE), tl.trans(v).to(DOT_DTYPE), input_precision=PRECISION)
        ds = c * (content_weight * (dp - delta[:, None]))
        dk += tl.dot(tl.trans(ds.to(q.dtype)).to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=PRECISION)
    tl.store(
        dk_ptr + bh * NK * D + offs_n[:, None] * D + offs_d[None, :],
        (dk * scale).to(dk_ptr.dtype.element_ty),
        mask=key_mask,
    )
    tl.store(
        dv_ptr + bh * NK * DV + offs_n[:, None] * DV + offs_e[None, :],
        dv.to(dv_ptr.dtype.element_ty),
        mask=value_mask,
    )


def query_grad_kernel(
    q_ptr, k_ptr, v_ptr, gate_ptr, grad_ptr, lse_ptr, delta_ptr, dq_ptr,
    H, NQ, NK, D, DV, V_HEADS, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_DV)
    row_valid = offs_m < NQ
    query_mask = row_valid[:, None] & (offs_d[None, :] < D)
    q = tl.load(q_ptr + bh * NQ * D + offs_m[:, None] * D + offs_d[None, :], mask=query_mask, other=0.0)
    grad = tl.load(
        grad_ptr + bh * NQ * DV + offs_m[:, None] * DV + offs_e[None, :],
        mask=row_valid[:, None] & (offs_e[None, :] < DV),
        other=0.0,
    )
    lse = tl.load(lse_ptr + bh * NQ + offs_m, mask=row_valid, other=0.0)
    delta = tl.load(delta_ptr + bh * NQ + offs_m, mask=row_valid, other=0.0)
    content_weight = 1.0 - tl.load(gate_ptr + h).to(tl.float32)
    k_base = k_ptr + bh * NK * D
    v_base = v_ptr + (b * V_HEADS + h % V_HEADS) * NK * DV
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, NK, BLOCK_N):
        offs_n = start_n + offs_n0
        k = tl.load(
            k_base + offs_n[:, None] * D + offs_d[None, :],
            mask=(offs_n[:, None] < NK) & (offs_d[None, :] < D),
            other=0.0,
        )
        v = tl.load(
            v_base + offs_n[:, None] * DV + offs_e[None, :],
            mask=(offs_n[:, None] < NK) & (offs_e[None, :] < DV),
            other=0.0,
        )
        s = tl.dot(q.to(DOT_DTYPE), tl.trans(k).to(DOT_DTYPE), input_precision=PRECISION) * scale
        c = tl.exp(s - lse[:, None])
        c = tl.where(row_valid[:, None] & (offs_n[None, :] < NK), c, 0.0)
        dp = tl.dot(grad.to(DOT_DTYPE), tl.trans(v).to(DOT_DTYPE), input_precision=PRECISION)
        ds = c * (content_weight * (dp - delta[:, None]))
        dq += tl.dot(ds.to(k.dtype).to(DOT_DTYPE), k.to(DOT_DTYPE), input_precision=PRECISION)
    tl.store(
        dq_ptr + bh * NQ * D + offs_m[:, None] * D + offs_d[None, :],
        (dq * scale).to(dq_ptr.dtype.element_ty),
        mask=query_mask,
    )
