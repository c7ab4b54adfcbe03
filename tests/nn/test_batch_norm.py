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
