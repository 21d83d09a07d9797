//! ONNX protobuf builders for hand-made test graphs.

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
