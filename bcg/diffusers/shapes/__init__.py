"""The `shapes-flux` model's world: captioned pictures of shapes drawn here (`data`), a caption-adherence
score read from a picture (`score`), and the trained built-in pipeline (`model`)."""
