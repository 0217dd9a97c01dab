"""Writing a data set: input -> batches -> records -> shard files -> manifest.

- `inputs`: arrays, memmaps, h5py data sets, dicts, lists and iterables of batches
  become validated batches;
- `options`: `WriteOptions`, the writer's options, checked once;
- `plan`: `Layout`, how samples are cut into records and shards;
- `journal`: the output directory (overwrite, resume) and the journal of a conversion;
- `sink`: shard files, their framing, rotation and durability;
- `writer`: `RecordWriter`, the core, without Keras;
- `arrays_to_records`: `ArraysToRecords`, the public writer and Keras callback.

Nothing is imported here, so that importing one piece does not import Keras.
"""
