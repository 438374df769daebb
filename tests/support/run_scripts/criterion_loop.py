"""The standard loop of a classifier: ``loss = criterion(model(x), y)`` with an
``nn.CrossEntropyLoss``, and sample 3 of step 3's input made infinite. ``--out FILE`` saves
step 3's targets for the test to compare with the bundle's"""

import sys

import torch
from torch import nn


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 5))


def make_replay():  # the replay factory: the model and loss_fn(model, (x, y))
    criterion = nn.CrossEntropyLoss()
    return make_model(), lambda model, batch: criterion(model(batch[0]), batch[1])


def main() -> None:
    model = make_model()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(8, 6, generator=gen)
        y = torch.randint(0, 5, (8,), generator=gen)
        if step == 3:
            x[3] = float("inf")  # one sample's input overflows the logits
            if len(sys.argv) > 2:
                torch.save(y, sys.argv[2])
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    main()
