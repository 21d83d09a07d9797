//! ONNX protobuf builders for hand-made test graphs.

use std::io;

use pb::tensor_shape_proto::{Dimension, dimension};
use prost::Message;
use rookery_model::onnx::pb;

pub fn attr_int(name: &str, v: i64) -> pb::AttributeProto {
    pb::AttributeProto {
        name: Some(name.into()),
        r#type: Some(pb::attribute_proto::AttributeType::Int as i32),
        i: Some(v),
        ..Default::default()
    }
}

pub fn attr_tensor(name: &str, t: pb::TensorProto) -> pb::AttributeProto {
    pb::AttributeProto {
        name: Some(name.into()),
        r#type: Some(pb::attribute_proto::AttributeType::Tensor as i32),
        t: Some(t),
        ..Default::default()
    }
}

pub fn node(
    op: &str,
    ins: &[&str],
    out: &str,
    attribute: Vec<pb::AttributeProto>,
) -> pb::NodeProto {
    pb::NodeProto {
        op_type: Some(op.into()),
        name: Some(format!("n_{out}")),
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: vec![out.into()],
        attribute,
        ..Default::default()
    }
}

/// A named (symbolic) dimension of an input's shape.
pub fn dim_param(name: &str) -> Dimension {
    Dimension {
        value: Some(dimension::Value::DimParam(name.into())),
        ..Default::default()
    }
}

/// A fixed dimension of an input's shape.
pub fn dim_value(n: i64) -> Dimension {
    Dimension {
        value: Some(dimension::Value::DimValue(n)),
        ..Default::default()
    }
}

/// A model at `opset` of `nodes` and `inits`, reading one float input `x`
/// of shape `dims` and giving `output`.
pub fn model_bytes(
    opset: i64,
    dims: Vec<Dimension>,
    nodes: Vec<pb::NodeProto>,
    inits: Vec<pb::TensorProto>,
    output: &str,
) -> Vec<u8> {
    let x = pb::ValueInfoProto {
        name: Some("x".into()),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: Some(pb::tensor_proto::DataType::Float as i32),
                shape: Some(pb::TensorShapeProto { dim: dims }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    pb::ModelProto {
        ir_version: Some(9),
        opset_import: vec![pb::OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(opset),
        }],
        graph: Some(pb::GraphProto {
            node: nodes,
            initializer: inits,
            input: vec![x],
            output: vec![pb::ValueInfoProto {
                name: Some(output.into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// An external-data loader for models that have none.
pub fn no_external(_: &str) -> Result<Vec<u8>, io::Error> {
    Err(io::Error::new(io::ErrorKind::NotFound, "no such file"))
}
