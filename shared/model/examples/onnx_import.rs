//! Imports an ONNX file and prints the graph Rookery makes of it: one line per
//! node with its inferred output shape, the parameters by kind, and any warnings.
//! Usage: `cargo run -p rookery-model --example onnx_import -- model.onnx 2,3,32,32`

use rookery_model::ParamKind;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(path), Some(shape)) = (args.next(), args.next()) else {
        return Err("usage: onnx_import MODEL.onnx INPUT_SHAPE (e.g. 2,3,32,32)".into());
    };
    let shape = shape
        .split(',')
        .map(str::parse)
        .collect::<Result<Vec<usize>, _>>()?;
    let imported = rookery_model::onnx::import_file(&path, &shape)?;
    let analysis = imported.graph.analyze()?;
    for n in &analysis.nodes {
        let node = &imported.graph.nodes[n.index];
        println!(
            "{:<40} {:<18} {:?} <- {:?}",
            n.name, n.op, n.output.shape, node.inputs
        );
    }
    for kind in [ParamKind::Trainable, ParamKind::Buffer, ParamKind::Constant] {
        let names: Vec<String> = imported
            .graph
            .params
            .iter()
            .filter(|p| p.kind == kind)
            .map(|p| format!("{} {:?}", p.name, p.shape))
            .collect();
        println!("{kind:?} ({}): {}", names.len(), names.join(", "));
    }
    for w in &imported.warnings {
        println!("warning: {w}");
    }
    Ok(())
}
