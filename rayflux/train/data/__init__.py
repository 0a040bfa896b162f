"""The data feed: bucket-pure batch plans, storage-neighbour runs, the planned Ray Data feed, the plan cut for a world
size and a resume position, the empty caption for dropout."""
