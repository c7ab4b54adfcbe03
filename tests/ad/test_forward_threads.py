"""Forward-mode transforms in several threads at once.

torch has one forward-AD level for the whole process, and leaving it clears every tangent,
also those saved in the graph of a reverse level around a jvp. functx runs forward sections
one thread at a time (`functx.ad.level.dual_level`), so each thread computes what it computes
alone. Shared, the level was left by whichever thread finished last: the other thread's
backward, unpacking a saved tangent, met "a forward AD level with an invalid index" (7 to 53
of 100 runs of the stack below), or could have attached a stale tangent to the next level.
"""

import threading

import torch

import functx

D = torch.float64
ONES = torch.ones(3, 3, dtype=D)


def _f(a):
    w = a.clone()
    w[0] = w[0] * 2
    v = torch.sin(w).reshape(-1, 3)
    return torch.mm(v.mT, v)


def _hessian_of_jvp_of_vjp(x, t):
    # reverse levels around a jvp around a reverse level: their graphs save dual tensors
    inner = lambda a: functx.vjp(_f, a)[1](ONES)[0]
    return functx.hessian(lambda a: functx.jvp(inner, (a,), (t,))[1].sum())(x)


def _jacfwd_of_grad(x):
    return functx.jacfwd(functx.grad(lambda a: (a.exp() * a).sum()))(x)


def _reference_hessian_of_jvp_of_vjp(x, t):
    """Plain torch.autograd with create_graph: the Hessian of sum(H(x) t), H of sum(f)."""
    a = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(_f(a).sum(), a, create_graph=True)
    (hvp,) = torch.autograd.grad(g, a, t, create_graph=True)
    (g2,) = torch.autograd.grad(hvp.sum(), a, create_graph=True)
    return torch.stack([torch.autograd.grad(g2[i], a, retain_graph=True)[0] for i in range(len(x))])


def test_forward_transforms_in_two_threads_each_equal_the_reference():
    x, t = torch.linspace(-1, 1, 3, dtype=D), torch.linspace(0.5, 1.5, 3, dtype=D)
    jobs = [
        (lambda: _hessian_of_jvp_of_vjp(x, t), _reference_hessian_of_jvp_of_vjp(x, t)),
        (lambda: _jacfwd_of_grad(x), torch.diag(torch.exp(x) * (x + 2))),
    ]
    runs, outcomes, barrier = 60, [[], []], threading.Barrier(2)

    def work(k):
        run, _ = jobs[k]
        barrier.wait()
        for _ in range(runs):
            try:
                outcomes[k].append(run())
            except Exception as error:  # asserted below, in the main thread
                outcomes[k].append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for k, (_, expected) in enumerate(jobs):
        assert len(outcomes[k]) == runs
        for got in outcomes[k]:
            assert isinstance(got, torch.Tensor), f"thread {k} raised: {got!r}"
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert torch.autograd.forward_ad._current_level == -1, "functx left torch's dual level open"
