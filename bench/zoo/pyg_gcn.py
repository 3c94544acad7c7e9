"""A torch_geometric GCN (the library's `GCNConv` layers) for node
classification on a made-up graph with community structure, each rank on
its own neighbour-sampled-free subgraph batch; DDP, Adam, dropout."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_geometric.nn import GCNConv
from torch_geometric.utils import stochastic_blockmodel_graph

import zoocommon as zc


class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GCNConv(16, 32)
        self.conv2 = GCNConv(32, 4)

    def forward(self, x, edge_index):
        h = nn.functional.dropout(torch.relu(self.conv1(x, edge_index)), 0.3, self.training)
        return self.conv2(h, edge_index)


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = GCN()
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3, weight_decay=5e-4)
    graphs = []
    for k in range(8):  # a few graphs, cycled
        sizes = [50, 50, 50, 50]
        edge_index = stochastic_blockmodel_graph(sizes, torch.full((4, 4), 0.01) + 0.15 * torch.eye(4))
        y = torch.arange(4).repeat_interleave(50)
        x = torch.randn(200, 16) + nn.functional.one_hot(y, 4).repeat(1, 4).float() * 0.5
        graphs.append((x, edge_index, y))
    for step in range(a.steps):
        x, edge_index, y = graphs[step % len(graphs)]
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x, edge_index), y).backward()
        opt.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
