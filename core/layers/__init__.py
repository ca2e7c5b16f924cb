"""Building blocks shared by the zoo: attention kernels, MLPs, modulation, embeddings."""
