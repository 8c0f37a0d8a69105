package fleet_test

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kswitch/kswitch/agent"
	"github.com/kswitch/kswitch/config"
	"github.com/kswitch/kswitch/devstack"
	"github.com/kswitch/kswitch/fleet"
)

// exampleFleet starts an etcd in the process and returns an operator of
// fleet "orders" on it, over a client opened as OpenEtcd opens one;
// against a real fleet, fill config.Etcd from its settings instead.
func exampleFleet() (ctx context.Context, cli *clientv3.Client, op *fleet.Operator, stop func(), err error) {
	dir, err := os.MkdirTemp("", "kswitch-example")
	if err != nil {
		return nil, nil, nil, nil, err
	}
	e, err := devstack.StartEtcd(dir, zap.NewNop())
	if err != nil {
		os.RemoveAll(dir)
		return nil, nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	stop = func() {
		cancel()
		if cli != nil {
			cli.Close()
		}
		e.Stop()
		os.RemoveAll(dir)
	}
	if cli, err = fleet.OpenEtcd(ctx, config.Etcd{Endpoints: e.Endpoints(), DialTimeout: 5 * time.Second}, nil); err != nil {
		stop()
		return nil, nil, nil, nil, err
	}
	if op, err = fleet.NewOperator(cli, "orders"); err != nil {
		stop()
		return nil, nil, nil, nil, err
	}
	return ctx, cli, op, stop, nil
}

// An operator's program pins the fleet to cluster B, as 'kswitch failover
// --to B' does, then returns it to automatic failover.
func ExampleOperator_Pin() {
	ctx, cli, op, stop, err := exampleFleet()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()
	if err := op.Pin(ctx, "B"); err != nil {
		fmt.Println(err)
		return
	}
	resp, _ := cli.Get(ctx, op.Keys().Pin())
	fmt.Printf("%s = %s\n", resp.Kvs[0].Key, resp.Kvs[0].Value)
	if err := op.Unpin(ctx); err != nil {
		fmt.Println(err)
		return
	}
	resp, _ = cli.Get(ctx, op.Keys().Pin())
	fmt.Println("pins left:", resp.Count)
	// Output:
	// /kswitch/orders/control/pin = B
	// pins left: 0
}

// A status read, as 'kswitch status' makes it: here of a fleet no agent
// has joined yet.
func ExampleOperator_Status() {
	ctx, _, op, stop, err := exampleFleet()
	if err != nil {
		fmt.Println(err)
		return
	}
	defer stop()
	v, err := op.Status(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("fleet %s: %d agents, leader %q, active cluster known: %v\n", v.Fleet, len(v.Agents), v.Leader, v.Active != nil)
	// Output:
	// fleet orders: 0 agents, leader "", active cluster known: false
}

// A program runs one member of fleet "orders" as 'kswitch agent' does:
// it consumes A's topic orders (B's when the fleet fails over), routes
// every record by the routes in force to its channels, and stops cleanly
// on an interrupt, its partitions drained and committed.
func ExampleNewMember() {
	cfg, err := config.Load("kswitch.yaml") // or fill config.Default() in code
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	m, err := fleet.NewMember(cfg, agent.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := m.Run(ctx, 30*time.Second); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
