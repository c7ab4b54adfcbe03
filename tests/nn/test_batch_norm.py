import torch

import functx


def test_replace_all_batch_norm_modules_then_vmap_training_mode():
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.BatchNorm2d(3))
    assert functx.replace_all_batch_norm_modules_(net) is net
    for bn in (net[1], net[3]):
        assert bn.running_mean is None and bn.running_var is None and not bn.track_running_stats
    x = torch.randn(4, 5, 2, 6, 6)  # 4 independent batches of 5 images
    out = functx.vmap(net)(x)
    torch.testing.assert_close(out, torch.stack([net(xi) for xi in x]), atol=1e-5, rtol=1e-5)


def test_training_batch_norm_with_batched_buffers_backpropagates():
    """Running stats updated in place under vmap must not break a later backward."""
    models = [torch.nn.BatchNorm1d(3) for _ in range(2)]
    params, buffers = functx.stack_module_state(models)
    x = torch.randn(2, 5, 3)

    def run(p, b, xi):
        return functx.functional_call(models[0], (p, b), (xi,))

    out = functx.vmap(run)(params, buffers, x)
    out.pow(2).sum().backward()
    for i, model in enumerate(models):
        xi = x[i].clone().requires_grad_()
        model(xi).pow(2).sum().backward()
        torch.testing.assert_close(params["weight"].grad[i], model.weight.grad)
        torch.testing.assert_close(buffers["running_mean"][i], model.running_mean)
