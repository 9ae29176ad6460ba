"""Statistics of the Mixture-of-Logits gate pi(q, x) (Ding & Zhai, App. A.3; the load-balancing loss L_MI, Eq. 3),
as :mod:`pyterrier_prob.experiments.mol` reports them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pyterrier_prob.mol.scoring import gather_rows, tensor
from st_extensions.modules.mol import entropy

__all__ = ["gate_statistics"]


def gate_statistics(
    mol: Any,
    q_comps: np.ndarray,
    x_comps: np.ndarray,
    qi: np.ndarray,
    docids: np.ndarray,
    q_feats: np.ndarray | None = None,
    x_feats: np.ndarray | None = None,
    chunk: int = 4096,
) -> dict[str, Any]:
    """The gate pi(q, x) (App. A.3) of ``mol`` over the pairs (``q_comps[qi[i]]``, ``x_comps[docids[i]]``; side
    features ``q_feats``, ``x_feats`` when ``mol.gate_features``), ``chunk`` pairs at a time, entropies in nats.

    ``H_pi_given_qx`` is the mean per-pair gate entropy, ``H_p`` the entropy of the average gate p = mean pi (the
    load on the P pairs), ``MI`` = H_p - H_pi_given_qx = -L_MI (Eq. 3; 0 for a uniform gate); also ``pairs``, ``P``,
    ``log_P``, ``effective_pairs_exp_H_p``, ``mean_effective_pairs_exp_H_pi``, ``mean_max_pi`` and the ``(P_q, P_x)``
    matrices ``usage_mean_pi`` (p) and ``usage_argmax_share`` (how often each pair has the largest weight).
    """
    P = mol.num_query_components * mol.num_doc_components
    if len(qi) == 0:
        return {"pairs": 0, "P": P, "log_P": round(math.log(P), 4)}
    gates, cpu = [], torch.device("cpu")
    with torch.inference_mode():
        for a in range(0, len(qi), chunk):
            rows, docs = qi[a : a + chunk], docids[a : a + chunk]
            q, x = tensor(q_comps[rows], cpu, torch.float32), tensor(gather_rows(x_comps, docs), cpu, torch.float32)
            qf = xf = None
            if getattr(mol, "gate_features", False):
                qf = tensor(q_feats[rows], cpu, torch.float32)
                xf = tensor(gather_rows(x_feats, docs), cpu, torch.float32)[:, None]
            gates.append(mol.gate(q, x[:, None], qf, xf).reshape(len(q), -1).float().cpu().numpy())
    pi = np.concatenate(gates)
    usage = pi.mean(0)
    h_pi = entropy(torch.from_numpy(pi)).numpy()
    h_cond, h_marg = float(h_pi.mean()), float(entropy(torch.from_numpy(usage)))
    argmax = np.bincount(pi.argmax(1), minlength=P) / len(pi)
    return {
        "pairs": int(len(pi)),
        "P": P,
        "log_P": round(math.log(P), 4),
        "H_pi_given_qx": round(h_cond, 4),
        "H_p": round(h_marg, 4),
        "MI": round(h_marg - h_cond, 4) + 0.0,  # >= 0 (Jensen); + 0.0 turns a rounded -0.0 into 0.0
        "effective_pairs_exp_H_p": round(math.exp(h_marg), 3),
        "mean_effective_pairs_exp_H_pi": round(float(np.exp(h_pi).mean()), 3),
        "mean_max_pi": round(float(pi.max(1).mean()), 4),
        "usage_mean_pi": np.round(usage.reshape(mol.num_query_components, -1), 4).tolist(),
        "usage_argmax_share": np.round(argmax.reshape(mol.num_query_components, -1), 4).tolist(),
    }
