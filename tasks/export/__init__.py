"""Stage `export`: the fine-tuned pipeline to OpenVINO IR at static shapes (models/openvino/)."""
