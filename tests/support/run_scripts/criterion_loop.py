"""The standard loop of a classifier: ``loss = criterion(model(x), y)`` with an
``nn.CrossEntropyLoss`` (``--functional``: ``F.cross_entropy(model(x).view(-1, 5),
y.view(-1))``), and sample 3 of step 3's input made infinite (``--clean``: not).
``--out FILE`` saves step 3's targets for the test to compare with the bundle's; ``--weights
FILE`` the final weights; the script fails if anything is left on the torch function stack
after an optimizer step."""

import argparse

import torch
from torch import nn
from torch.nn import functional as F


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5))


def make_replay():  # the replay factory: the model and loss_fn(model, (x, y))
    criterion = nn.CrossEntropyLoss()
    return make_model(), lambda model, batch: criterion(model(batch[0]), batch[1])


def functional_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    accuracy = (out.argmax(1) == y).float().mean()  # computed first: not the loss
    assert 0.0 <= float(accuracy) <= 1.0
    return F.cross_entropy(out.view(-1, 5), y.view(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--weights")
    parser.add_argument("--functional", action="store_true")
    parser.add_argument("--clean", action="store_true")
    args = parser.parse_args()
    model = make_model()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(8, 6, generator=gen)
        y = torch.randint(0, 5, (8,), generator=gen)
        if step == 3:
            if not args.clean:
                x[3] = float("inf")  # one sample's input overflows the logits
            if args.out:
                torch.save(y, args.out)
        out = model(x)
        loss = functional_loss(out, y) if args.functional else criterion(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        stacked = torch._C._len_torch_function_stack()
        assert stacked == 0, f"{stacked} torch function modes left after step {step}"
    if args.weights:
        torch.save(model.state_dict(), args.weights)


if __name__ == "__main__":
    main()
